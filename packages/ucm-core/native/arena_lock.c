/* A process's lock over a dram arena: the mutex its threads take before the arena file's
 * flock (which does not exclude threads sharing one open file), here so that a compiled
 * load (arena_loads.c) takes the very lock Python's critical sections take
 * (ucm/core/store/dram/arena.py: Arena.locked).  Every wait is bounded: a holder stopped
 * (SIGSTOP, a debugger) would otherwise stall every engine on the host. */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "arena.h"
#include "arena_lock.h"


int64_t ucm_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t); /* Python's time.monotonic_ns */
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* A pause that doubles from 20 us to 1 ms (files.py: flock_until). */
static void pause_for(int64_t *ns) {
    struct timespec t = {0, (long)*ns};
    nanosleep(&t, NULL);
    *ns = *ns * 2 > 1000000 ? 1000000 : *ns * 2;
}

__attribute__((visibility("default"))) ucm_lock *ucm_lock_new(void) {
    ucm_lock *l = calloc(1, sizeof *l);
    if (l && pthread_mutex_init(&l->mu, NULL) != 0) {
        free(l);
        return NULL;
    }
    return l;
}

/* Only once nobody can use it any more (the Python object that owns it is gone). */
__attribute__((visibility("default"))) void ucm_lock_free(ucm_lock *l) {
    if (l) {
        pthread_mutex_destroy(&l->mu);
        free(l);
    }
}

__attribute__((visibility("default"))) int ucm_lock_try(ucm_lock *l) {
    return pthread_mutex_trylock(&l->mu) == 0;
}

/* Take the mutex by ``deadline`` (CLOCK_MONOTONIC ns): 1, or 0 once it passed. */
__attribute__((visibility("default"))) int ucm_lock_until(ucm_lock *l, int64_t deadline) {
    int64_t pause = 20000;
    while (pthread_mutex_trylock(&l->mu) != 0) {
        if (ucm_now_ns() >= deadline)
            return 0;
        pause_for(&pause);
    }
    return 1;
}

__attribute__((visibility("default"))) void ucm_lock_release(ucm_lock *l) {
    pthread_mutex_unlock(&l->mu);
}

/* Mark the arena closed (its holder calls it): a compiled load that takes the mutex later
 * touches nothing, its lock file's descriptor perhaps another file's by then. */
__attribute__((visibility("default"))) void ucm_lock_close(ucm_lock *l) { l->closed = 1; }

int ucm_arena_hold(ucm_lock *l, int lock_fd, int file_fd, uint64_t file_bytes,
                   const uint64_t *sb, int64_t deadline) {
    if (!ucm_lock_until(l, deadline))
        return HOLD_BUSY;
    if (l->closed) {
        pthread_mutex_unlock(&l->mu);
        return HOLD_ELSEWHERE;
    }
    /* the file cut short: touching a page past its end would be a SIGBUS */
    off_t size = lseek(file_fd, 0, SEEK_END);
    if (size < 0 || (uint64_t)size < file_bytes) {
        pthread_mutex_unlock(&l->mu);
        return HOLD_ELSEWHERE;
    }
    int64_t pause = 20000;
    while (flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
        int held_elsewhere = errno == EWOULDBLOCK || errno == EINTR;
        if (!held_elsewhere || ucm_now_ns() >= deadline) {
            pthread_mutex_unlock(&l->mu);
            return held_elsewhere ? HOLD_BUSY : HOLD_ELSEWHERE;
        }
        pause_for(&pause);
    }
    if (sb[UCM_SB_DIRTY]) { /* a holder died mid-change: Python's critical section mends it */
        ucm_arena_let_go(l, lock_fd);
        return HOLD_ELSEWHERE;
    }
    return HOLD_HELD;
}

void ucm_arena_let_go(ucm_lock *l, int lock_fd) {
    flock(lock_fd, LOCK_UN);
    pthread_mutex_unlock(&l->mu);
}
