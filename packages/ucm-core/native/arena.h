/* The dram arena's sections as the compiled calls see them (ucm/core/store/dram/layout.py
 * for the file, arena.py for the rules), and the calls they share.  Every word of the arena
 * is hostile: another process of the user may have written anything there. */
#ifndef UCM_ARENA_H
#define UCM_ARENA_H

#include <stddef.h>
#include <stdint.h>

#define UCM_SEAL_BYTES 32
/* superblock words (layout.py: SB_*) and the walk past which the index is rebuilt
 * (index.py: LONG_WALK) */
#define UCM_SB_TICK 5
#define UCM_SB_DIRTY 6
#define UCM_SB_FREE_TOP 7
#define UCM_SB_USED 9
#define UCM_SB_TOMBS 12
#define UCM_SB_BYTES 14
#define UCM_LONG_WALK 256
/* slot states (layout.py) and index words (index.py) */
#define UCM_FREE 0u
#define UCM_WRITING 1u
#define UCM_READY 2u
#define UCM_EMPTY 0xFFFFFFFFu
#define UCM_TOMB 0xFFFFFFFEu

/* The sections the calls read and write, their addresses in this order in ``cols``. */
enum { C_SB, C_STATE, C_PINS, C_GEN, C_KEY0, C_KEY1, C_LENGTH, C_LAYOUT, C_USED, C_LEASE,
       C_SEAL, C_IK0, C_IK1, C_ISLOT, C_OWNER, C_FREE, C_COUNT };

typedef struct {
    uint64_t *sb;
    uint32_t *state, *pins, *gen, *owner, *free;
    uint64_t *key0, *key1, *length, *layout, *used;
    int64_t *lease;
    uint8_t *seal;
    uint64_t *ik0, *ik1;
    uint32_t *islot;
    uint64_t slots, buckets, salt;
} ucm_arena;

ucm_arena ucm_arena_columns(const uint64_t *cols, uint64_t slots, uint64_t buckets,
                            uint64_t salt);
/* The bucket holding the key, or -1 (index.py: Index.find); ``*walk`` gets the steps, at
 * most one a bucket whatever the index holds. */
int64_t ucm_arena_find(const ucm_arena *a, uint64_t k0, uint64_t k1, uint64_t *walk);
/* A key's first bucket (index.py: Index.home). */
uint64_t ucm_arena_home(const ucm_arena *a, uint64_t k0);
/* Pin key i (words keys[2i], keys[2i+1]): row i of ``rows`` gets its slot (``slots`` where
 * it is not stored), gen, length and layout, ``seals`` its seal.  The longest index walk. */
uint64_t ucm_arena_pin_keys(const ucm_arena *a, uint64_t n, const uint64_t *keys,
                            int64_t lease_until, uint64_t *rows, uint8_t *seals);
/* Let go of pin i (slot pinned[2i] at gen pinned[2i+1]); same[i]: whether it held. */
void ucm_arena_unpin_pins(const ucm_arena *a, uint64_t n, const uint64_t *pinned,
                          uint8_t *same);

#endif
