import math

import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from ucm.core.config import DramStoreConfig, HybridSettings, PosixStoreConfig, TieredStoreConfig
from ucm.core.hybrid import (
    HybridLayout,
    KVGroup,
    plan_load,
    tail_range,
    usable_hit,
    wa_lookup_boundaries,
)
from ucm.core.hybrid_store import plan_dump, split_store_config
from ucm.core.settings import GIB, ConfigError, from_dict

PROPS = settings(max_examples=300, deadline=None)


def seed_001_layout():
    """DeepSeek-V4's groups as seed 001 logged them: block sizes (256, 64, 64, 4, 8) and
    tail_blocks (None, 2, 2, 1, 0); the windows and ratios are chosen to reproduce them."""
    return HybridLayout(
        [
            KVGroup("full", 256, num_layers=43),
            KVGroup("window", 64, 128),  # sliding window of 128 tokens: 2 blocks of 64
            KVGroup("window", 64, 132, compress_ratio=4),  # 132 - 4 = 128 tokens: 2 blocks
            KVGroup("window", 4, 8, compress_ratio=4),  # compressor state: 8 - 4 = 4 tokens
            KVGroup("window", 8, 128, compress_ratio=128),  # window == ratio: nothing
        ],
        boundary_tokens=256,
    )


def sliding_layout():
    """The docs' example: full attention in 256-token blocks, a 128-token window in 64."""
    return HybridLayout([KVGroup("full", 256), KVGroup("window", 64, 128)], 256)


# --- examples -------------------------------------------------------------------------------


def test_seed_001_tail_blocks():
    layout = seed_001_layout()
    assert layout.tail_blocks == (None, 2, 2, 1, 0)
    assert layout.full_groups == (0,)
    assert layout.window_groups == (1, 2, 3, 4)
    assert layout.tail_groups == (1, 2, 3)
    assert [g.tail_tokens for g in layout.groups] == [None, 128, 128, 4, 0]
    assert [layout.blocks_per_boundary(g) for g in range(5)] == [1, 4, 4, 64, 32]


def test_tail_range():
    layout = seed_001_layout()
    assert tail_range(layout, 1, 3) == range(10, 12)  # tokens 640..767
    assert tail_range(layout, 3, 1) == range(63, 64)  # tokens 252..255
    assert tail_range(layout, 4, 2) == range(64, 64)  # nothing
    assert tail_range(layout, 1, 0) == range(0, 0)
    small = HybridLayout([KVGroup("full", 16), KVGroup("window", 16, 100)], 32)
    assert tail_range(small, 1, 1) == range(0, 2)  # cut at block 0: 2 of 7 blocks
    assert tail_range(small, 1, 5) == range(3, 10)
    with pytest.raises(ValueError, match="full-attention"):
        tail_range(layout, 0, 1)


def test_docs_example_block_wise_and_chunk_wise():
    layout = sliding_layout()
    prompt, chunks = 1000, (512, 488)
    for block_wise, tails in ((True, [(1, 2), (3,)]), (False, [(2,), (3,)])):
        dumped, computed = 0, 0
        for chunk, expected in zip(chunks, tails):
            computed += chunk
            plan = plan_dump(
                layout,
                dumped=dumped,
                computed_tokens=computed,
                chain_blocks=prompt // 256,
                block_wise=block_wise,
            )
            assert plan.window_boundaries == expected
            dumped = plan.dumped
        assert dumped == 3
    first = plan_dump(layout, dumped=0, computed_tokens=512, chain_blocks=3)
    assert first.full_blocks == (0, 1)
    assert [(r.key, r.engine_blocks) for r in first.window] == [(0, range(2, 4)), (1, range(6, 8))]
    load = plan_load(layout, 0, 3)
    assert [(r.key, r.engine_blocks) for r in load.full] == [(0, range(0, 1)), (1, range(1, 2))] + [
        (2, range(2, 3))
    ]
    assert [(r.group, r.key, r.engine_blocks) for r in load.window] == [(1, 2, range(10, 12))]
    assert load.tokens == 768


def test_load_leaves_what_the_engine_holds():
    layout = HybridLayout([KVGroup("full", 16), KVGroup("window", 16, 64)], 64)
    plan = plan_load(layout, local_tokens=80, hit=3)  # the engine holds 5 blocks of 16
    assert [(r.key, r.engine_blocks, r.fill) for r in plan.full] == [
        (1, range(4, 8), range(5, 8)),
        (2, range(8, 12), range(8, 12)),
    ]
    assert [(r.key, r.engine_blocks, r.fill) for r in plan.window] == [
        (2, range(8, 12), range(8, 12))
    ]
    assert plan.tokens == 112
    assert plan_load(layout, local_tokens=192, hit=3).blocks == ()
    assert plan_load(layout, local_tokens=0, hit=0).blocks == ()


def test_usable_hit_examples():
    layout = seed_001_layout()
    t, f = True, False
    stored = {1: [t, t, t, f], 2: [t, f, t, t], 3: [t, t, t, t]}
    assert usable_hit(layout, 4, stored) == 3
    assert usable_hit(layout, 2, stored) == 1
    assert usable_hit(layout, 4, stored, floor=3) == 0
    assert usable_hit(layout, 0, stored) == 0
    assert usable_hit(layout, 4, {1: [t], 2: [t], 3: [t]}) == 1  # short: not stored beyond
    with pytest.raises(ValueError, match="window group 3"):
        usable_hit(layout, 4, {1: [t], 2: [t]})
    assert list(wa_lookup_boundaries(layout, 5, floor=2)) == [3, 4, 5]
    full_only = HybridLayout([KVGroup("full", 16), KVGroup("window", 16, 4, compress_ratio=4)], 16)
    assert usable_hit(full_only, 7, {}) == 7
    assert list(wa_lookup_boundaries(full_only, 7)) == []


def test_window_only_layout():
    layout = HybridLayout([KVGroup("window", 16, 32)], 32)
    assert layout.full_groups == ()
    plan = plan_dump(layout, dumped=0, computed_tokens=100, chain_blocks=3)
    assert plan.full_blocks == () and plan.window_boundaries == (1, 2, 3)
    assert usable_hit(layout, 3, {0: [True, False, True]}) == 3
    assert plan_load(layout, 0, 3).full == ()


def test_dump_examples():
    layout = sliding_layout()
    assert plan_dump(layout, dumped=2, computed_tokens=600, chain_blocks=9).blocks == ()
    plan = plan_dump(layout, dumped=2, computed_tokens=2000, chain_blocks=5, block_wise=False)
    assert (plan.start, plan.dumped, plan.full_blocks, plan.window_boundaries) == (
        2,
        5,
        (2, 3, 4),
        (5,),
    )
    plan = plan_dump(layout, dumped=0, computed_tokens=2048, chain_blocks=8, wa_after=5)
    assert plan.full_blocks == tuple(range(8)) and plan.window_boundaries == (6, 7, 8)
    ranks = [
        plan_dump(
            layout, dumped=1, computed_tokens=2048, chain_blocks=8, rank=r, world_size=3, split=True
        )
        for r in range(3)
    ]
    assert [p.full_blocks for p in ranks] == [(3, 6), (1, 4, 7), (2, 5)]
    assert [p.window_boundaries for p in ranks] == [(4, 7), (2, 5, 8), (3, 6)]


# --- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"kind": "global", "block_tokens": 16}, "kind"),
        ({"kind": "full", "block_tokens": 0}, "block_tokens"),
        ({"kind": "full", "block_tokens": 16.0}, "block_tokens"),
        ({"kind": "full", "block_tokens": True}, "block_tokens"),
        ({"kind": "window", "block_tokens": 16}, "window_tokens"),
        ({"kind": "window", "block_tokens": 16, "window_tokens": -4}, "window_tokens"),
        ({"kind": "full", "block_tokens": 16, "window_tokens": 128}, "window_tokens"),
        ({"kind": "window", "block_tokens": 16, "window_tokens": 8, "compress_ratio": 0}, "ratio"),
        ({"kind": "full", "block_tokens": 16, "bytes_per_token_layer": -1}, "bytes_per_token"),
        ({"kind": "full", "block_tokens": 16, "bytes_per_token_layer": math.nan}, "bytes_per"),
        ({"kind": "full", "block_tokens": 16, "num_layers": -1}, "num_layers"),
    ],
)
def test_group_validation(kwargs, field):
    with pytest.raises(ConfigError, match=field):
        KVGroup(**kwargs)


def test_layout_validation():
    with pytest.raises(
        ConfigError, match=r"boundary_tokens: 256 is not a multiple .* 96 .*group 1"
    ):
        HybridLayout([KVGroup("full", 16), KVGroup("window", 96, 192)], 256)
    with pytest.raises(ConfigError, match="boundary_tokens"):
        HybridLayout([KVGroup("full", 16)], 0)
    with pytest.raises(ConfigError, match="groups"):
        HybridLayout([], 256)
    with pytest.raises(ConfigError, match=r"groups\[0\]"):
        HybridLayout([("full", 16)], 256)
    with pytest.raises(ConfigError, match="stores anything"):
        HybridLayout([KVGroup("window", 16, 8, compress_ratio=8)], 256)


def test_planner_argument_validation():
    layout = sliding_layout()
    with pytest.raises(ConfigError, match="rank"):
        plan_dump(layout, dumped=0, computed_tokens=0, chain_blocks=0, rank=2, world_size=2)
    with pytest.raises(ConfigError, match="computed_tokens"):
        plan_dump(layout, dumped=0, computed_tokens=-1, chain_blocks=0)
    with pytest.raises(ConfigError, match="local_tokens"):
        plan_load(layout, -1, 2)
    with pytest.raises(ConfigError, match="fa_prefix"):
        usable_hit(layout, -1, {1: []})


# --- settings and the two stores ------------------------------------------------------------


def test_settings():
    assert HybridSettings() == HybridSettings(wa_dump_block_wise=True, wa_capacity_fraction=0.5)
    for bad in (0, 1, 1.5, -0.1, "0.5", True, math.nan):
        with pytest.raises(ConfigError, match="wa_capacity_fraction"):
            from_dict(HybridSettings, {"wa_capacity_fraction": bad})
    with pytest.raises(ConfigError, match="wa_dump_block_wise"):
        from_dict(HybridSettings, {"wa_dump_block_wise": "yes"})


def _bytes(config):
    return config.capacity_bytes or 0


def test_split_posix(tmp_path):
    fa, wa = split_store_config(PosixStoreConfig(path=str(tmp_path), capacity_gb=10, fsync="data"))
    assert (fa.path, wa.path) == (str(tmp_path / "fa"), str(tmp_path / "wa"))
    assert (fa.capacity_gb, wa.capacity_gb) == (5, 5)
    assert fa.fsync == wa.fsync == "data"
    fa, wa = split_store_config(PosixStoreConfig(path=str(tmp_path), capacity_gb=None), 0.25)
    assert fa.capacity_gb is None and wa.capacity_gb is None
    # 'auto' is worked out once and split like a number
    auto = PosixStoreConfig(path=str(tmp_path))
    fa, wa = split_store_config(auto, 0.25)
    assert fa.capacity_gb + wa.capacity_gb == pytest.approx(auto.capacity_bytes / (1 << 30))
    assert wa.capacity_gb == pytest.approx(fa.capacity_gb / 3)


def test_split_dram_and_tiered(tmp_path):
    private = DramStoreConfig(capacity_gb=8, scope="process", preallocate=True)
    fa, wa = split_store_config(private, 0.25)
    assert (fa.capacity_gb, wa.capacity_gb, fa.preallocate) == (6, 2, True)
    assert fa.path == wa.path  # process memory has no path
    fa, wa = split_store_config(DramStoreConfig(capacity_gb=8, path="/dev/shm/u"), 0.25)
    assert (fa.capacity_gb, wa.capacity_gb) == (6, 2)
    assert (fa.path, wa.path) == ("/dev/shm/u/fa", "/dev/shm/u/wa")  # shared memory: apart
    tiered = TieredStoreConfig(
        dram=DramStoreConfig(capacity_gb=4),
        backing=PosixStoreConfig(path=str(tmp_path), capacity_gb=100),
    )
    fa, wa = split_store_config(tiered, 0.5)
    assert (fa.dram.capacity_gb, wa.dram.capacity_gb) == (2, 2)
    assert (fa.backing.capacity_gb, wa.backing.capacity_gb) == (50, 50)
    assert (fa.backing.path, wa.backing.path) == (str(tmp_path / "fa"), str(tmp_path / "wa"))
    fa, wa = split_store_config(TieredStoreConfig(backing=DramStoreConfig(capacity_gb=3)))
    assert fa.backing.capacity_gb + wa.backing.capacity_gb == 3


@pytest.mark.parametrize("bad", [0, 1, -0.5, 2, None, "half", True, math.nan])
def test_split_refuses_bad_fraction(bad):
    with pytest.raises(ConfigError, match="wa_capacity_fraction"):
        split_store_config(DramStoreConfig(), bad)


@given(st.floats(1e-6, 1e6, allow_nan=False), st.floats(1e-4, 1 - 1e-4, exclude_max=True))
@PROPS
def test_split_never_exceeds_the_capacity(capacity, fraction):
    fa, wa = split_store_config(DramStoreConfig(capacity_gb=capacity), fraction)
    assert fa.capacity_gb > 0 and wa.capacity_gb > 0
    assert _bytes(fa) + _bytes(wa) <= int(capacity * GIB)
    assert math.isclose(wa.capacity_gb, capacity * fraction)


# --- properties -----------------------------------------------------------------------------


@st.composite
def layouts(draw):
    boundary = draw(st.sampled_from([4, 8, 16, 32]))
    sizes = [d for d in range(1, boundary + 1) if boundary % d == 0]
    groups = [KVGroup("full", draw(st.sampled_from(sizes))) for _ in range(draw(st.integers(0, 2)))]
    for _ in range(draw(st.integers(0 if groups else 1, 3))):
        groups.append(
            KVGroup(
                "window",
                draw(st.sampled_from(sizes)),
                draw(st.integers(1, 4 * boundary)),
                compress_ratio=draw(st.sampled_from([1, 1, 2, 4, boundary])),
            )
        )
    assume(any(g.kind == "full" or g.tail_blocks for g in groups))
    return HybridLayout(draw(st.permutations(groups)), boundary)


@st.composite
def schedules(draw, boundary):
    """A prompt's length, its chunks (the last may run into decoding) and its chain length."""
    chain = draw(st.integers(0, 10))
    prompt = chain * boundary + draw(st.integers(0, boundary - 1))
    chunks, done = [], 0
    while done < prompt:
        chunk = draw(st.integers(1, max(1, 3 * boundary)))
        chunks.append(chunk)
        done += chunk
    return prompt, chunks, chain


def run_dumps(
    layout, chunks, chain, *, block_wise, rank=0, world_size=1, split=False, start=0, wa_after=0
):
    """Every step's plan for one rank, and the (group, key, engine_blocks) it writes."""
    plans, written, dumped, computed = [], set(), start, 0
    for chunk in chunks:
        computed += chunk
        plan = plan_dump(
            layout,
            dumped=dumped,
            computed_tokens=computed,
            chain_blocks=chain,
            block_wise=block_wise,
            rank=rank,
            world_size=world_size,
            split=split,
            wa_after=wa_after,
        )
        assert plan.start == dumped and plan.dumped >= dumped
        dumped = plan.dumped
        plans.append(plan)
        written |= {(r.group, r.key, r.engine_blocks) for r in plan.blocks}
    assert dumped == min(chain, computed // layout.boundary_tokens) or dumped == start
    return plans, written


def look_up(layout, store, chain, floor):
    """What an adapter does: the stored prefix of every full group, then the tails."""
    fa_prefix = chain
    for g in layout.full_groups:
        k = layout.blocks_per_boundary(g)
        s = 0
        while s < chain and (g, s, range(s * k, (s + 1) * k)) in store:
            s += 1
        fa_prefix = min(fa_prefix, s)
    wa_stored = {}
    for g in layout.tail_groups:
        flags = [False] * fa_prefix
        for b in wa_lookup_boundaries(layout, fa_prefix, floor):
            flags[b - 1] = (g, b - 1, tail_range(layout, g, b)) in store
        wa_stored[g] = flags
    return fa_prefix, wa_stored


@given(st.data())
@PROPS
def test_every_planned_load_was_stored(data):
    layout = data.draw(layouts())
    T = layout.boundary_tokens
    prompt, chunks, chain = data.draw(schedules(T))
    world = data.draw(st.integers(1, 3))
    split = data.draw(st.booleans())
    block_wise = data.draw(st.booleans())
    wa_after = data.draw(st.integers(0, chain + 1))
    store = set()
    for rank in range(world):
        store |= run_dumps(
            layout,
            chunks,
            chain,
            block_wise=block_wise,
            rank=rank,
            world_size=world,
            split=split,
            wa_after=wa_after,
        )[1]
    evicted = data.draw(st.sets(st.sampled_from(sorted(store, key=repr)))) if store else set()
    store -= evicted
    local = data.draw(st.integers(0, prompt))
    floor = local // T
    fa_prefix, wa_stored = look_up(layout, store, chain, floor)
    hit = usable_hit(layout, fa_prefix, wa_stored, floor=floor)
    assert hit <= fa_prefix
    plan = plan_load(layout, local, hit)
    event("loads nothing" if not plan.blocks else f"loads window tails: {bool(plan.window)}")
    if hit * T <= local:
        assert plan.blocks == () and plan.tokens == 0
        return
    assert plan.tokens == hit * T - local
    for ref in plan.blocks:
        assert (ref.group, ref.key, ref.engine_blocks) in store
        assert ref.fill and ref.fill.stop == ref.engine_blocks.stop
        assert ref.fill.start >= local // layout.groups[ref.group].block_tokens
        assert ref.engine_blocks.stop * layout.groups[ref.group].block_tokens <= hit * T
    for g in layout.full_groups:
        keys = [r.key for r in plan.full if r.group == g]
        assert keys == list(range(floor, hit))
    assert [r.group for r in plan.window] == list(layout.tail_groups)
    for ref in plan.window:
        assert ref.key == hit - 1
        assert len(ref.engine_blocks) <= layout.groups[ref.group].tail_blocks
        assert ref.engine_blocks == tail_range(layout, ref.group, hit)


@given(st.data())
@PROPS
def test_usable_hit_is_the_largest_agreeing_boundary(data):
    layout = data.draw(layouts())
    fa_prefix = data.draw(st.integers(0, 12))
    floor = data.draw(st.integers(0, 12))
    wa_stored = {
        g: data.draw(st.lists(st.booleans(), max_size=fa_prefix + 2)) for g in layout.tail_groups
    }
    hit = usable_hit(layout, fa_prefix, wa_stored, floor=floor)

    def agrees(b):
        return all(b <= len(f) and f[b - 1] for f in wa_stored.values())

    agreeing = [b for b in range(floor + 1, fa_prefix + 1) if agrees(b)]
    assert hit == max(agreeing, default=0)
    assert hit <= fa_prefix
    if not layout.tail_groups:
        assert hit == (fa_prefix if fa_prefix > floor else 0)


@given(st.data())
@PROPS
def test_block_wise_and_chunk_wise_dumps_agree_at_chunk_ends(data):
    layout = data.draw(layouts())
    _prompt, chunks, chain = data.draw(schedules(layout.boundary_tokens))
    block_plans, block_set = run_dumps(layout, chunks, chain, block_wise=True)
    chunk_plans, chunk_set = run_dumps(layout, chunks, chain, block_wise=False)
    assert [p.full for p in block_plans] == [p.full for p in chunk_plans]
    assert [p.dumped for p in block_plans] == [p.dumped for p in chunk_plans]
    ends = [p.dumped for p in chunk_plans if p.dumped > p.start]
    chunk_bounds = [b for p in chunk_plans for b in p.window_boundaries]
    block_bounds = [b for p in block_plans for b in p.window_boundaries]
    if layout.tail_groups:
        assert chunk_bounds == ends
        assert block_bounds == list(range(1, (ends or [0])[-1] + 1))
    else:
        assert chunk_bounds == block_bounds == []
    assert chunk_set <= block_set
    for plan in block_plans:
        for ref in plan.window:
            assert len(ref.engine_blocks) <= layout.groups[ref.group].tail_blocks


@given(st.data())
@PROPS
def test_tensor_parallel_split(data):
    layout = data.draw(layouts())
    _prompt, chunks, chain = data.draw(schedules(layout.boundary_tokens))
    world = data.draw(st.integers(2, 4))
    block_wise = data.draw(st.booleans())
    whole_plans, whole = run_dumps(layout, chunks, chain, block_wise=block_wise)
    parts = [
        run_dumps(
            layout, chunks, chain, block_wise=block_wise, rank=r, world_size=world, split=True
        )
        for r in range(world)
    ]
    union, fa_owner, wa_owner = set(), {}, {}
    for rank, (plans, written) in enumerate(parts):
        assert not union & written  # ranks are disjoint
        union |= written
        assert [p.dumped for p in plans] == [p.dumped for p in whole_plans]
        for plan in plans:
            fa_owner.update((s, rank) for s in plan.full_blocks)
            wa_owner.update((b, rank) for b in plan.window_boundaries)
    assert union == whole
    assert all(rank == (b - 1) % world for b, rank in wa_owner.items())
    if layout.full_groups:  # a tail at b goes with full block b - 1
        assert all(fa_owner[b - 1] == rank for b, rank in wa_owner.items())
    for rank in range(world):  # not split: every rank writes everything (its own shard)
        _plans, written = run_dumps(
            layout, chunks, chain, block_wise=block_wise, rank=rank, world_size=world
        )
        assert written == whole
