/* A process's lock over a dram arena (arena_lock.c). */
#ifndef UCM_ARENA_LOCK_H
#define UCM_ARENA_LOCK_H

#include <pthread.h>
#include <stdint.h>

typedef struct {
    pthread_mutex_t mu;
    int closed; /* set by the arena's close, under the mutex */
} ucm_lock;

enum {
    HOLD_HELD = 0,     /* the mutex and the flock held, the books whole */
    HOLD_BUSY = 1,     /* not had by the deadline */
    HOLD_ELSEWHERE = 2 /* closed, cut short or mid-mend: Python's critical section answers */
};

int64_t ucm_now_ns(void);
int ucm_lock_until(ucm_lock *l, int64_t deadline);
/* Take the arena's lock as Arena.locked does (the mutex, the file's size, the flock) by
 * ``deadline``; ``sb`` its superblock. */
int ucm_arena_hold(ucm_lock *l, int lock_fd, int file_fd, uint64_t file_bytes,
                   const uint64_t *sb, int64_t deadline);
void ucm_arena_let_go(ucm_lock *l, int lock_fd);

#endif
