"""The one slot pool (`pools.slots.SlotPool`) under SharedMemoryConnector's segments, ZmqConnector's, the
engine-pull connectors' and Mooncake's registered pool: growth up to its ceiling, one growth at a time,
idle release, slot headers before page-aligned frames."""

from __future__ import annotations

import threading
import time

from omni_mesh.connectors.pools.allocator import PAGE
from omni_mesh.connectors.pools.growth import GROW_STEP
from omni_mesh.connectors.pools.slots import SlotPool

MiB = 1 << 20


class Mapper:
    """Records the regions the pool asks its owner to map; refuses them while `refuse` is set."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.mapped: list[tuple[int, int]] = []
        self.refuse = False
        self.delay_s = delay_s  # mapping (and pre-faulting) takes a while: others ask meanwhile

    def __call__(self, base: int, size: int) -> bool:
        if self.refuse:
            return False
        time.sleep(self.delay_s)
        self.mapped.append((base, size))
        return True


def test_a_pool_without_a_ceiling_never_grows() -> None:
    pool, mapper = SlotPool(MiB), Mapper()
    assert pool.allocate_growing(MiB, mapper) == 0
    assert pool.allocate_growing(4096, mapper) is None
    assert mapper.mapped == [] and pool.regions == 1


def test_growth_maps_a_region_at_the_base_it_is_given_up_to_the_ceiling() -> None:
    pool, mapper = SlotPool(MiB, ceiling=MiB + 3 * GROW_STEP), Mapper()
    assert pool.allocate_growing(MiB, mapper) == 0
    offset = pool.allocate_growing(3 * MiB, mapper)
    assert mapper.mapped == [(MiB, GROW_STEP)] and offset == MiB  # page-aligned base, after the first
    assert pool.region_of(offset) == (MiB, 0) and pool.holds(offset)
    second = pool.allocate_growing(GROW_STEP, mapper)  # fits no free space: a region sized for it
    assert second == MiB + GROW_STEP and mapper.mapped[1] == (MiB + GROW_STEP, 2 * GROW_STEP)
    assert pool.allocate_growing(GROW_STEP, mapper) == second + GROW_STEP  # the rest of that region
    assert pool.allocate_growing(GROW_STEP, mapper) is None  # one more region would pass the ceiling
    assert pool.size == MiB + 3 * GROW_STEP and len(mapper.mapped) == 2
    pool.free(offset)
    assert not pool.holds(offset)


def test_a_region_its_owner_cannot_map_is_not_added() -> None:
    pool, mapper = SlotPool(MiB, ceiling=64 * MiB), Mapper()
    pool.allocate_growing(MiB, mapper)
    mapper.refuse = True
    assert pool.allocate_growing(MiB, mapper) is None and pool.regions == 1
    mapper.refuse = False
    assert pool.allocate_growing(MiB, mapper) == MiB and pool.regions == 2


def test_concurrent_allocations_grow_the_pool_once() -> None:
    pool, mapper = SlotPool(MiB, ceiling=256 * MiB), Mapper(delay_s=0.05)
    pool.allocate_growing(MiB, mapper)  # the first region is full
    start = threading.Barrier(8)
    offsets: list[int | None] = []

    def allocate() -> None:
        start.wait()
        offsets.append(pool.allocate_growing(MiB, mapper))

    threads = [threading.Thread(target=allocate) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert None not in offsets and len(set(offsets)) == 8
    assert mapper.mapped == [(MiB, GROW_STEP)]  # 8 MiB fit the one region the first of them added


def test_idle_grown_regions_go_back_but_the_first_stays() -> None:
    pool, mapper = SlotPool(MiB, ceiling=64 * MiB), Mapper()
    first = pool.allocate_growing(MiB, mapper)
    grown = pool.allocate_growing(MiB, mapper)
    assert pool.release_idle(0.0) == []  # both hold a payload
    pool.free(grown)
    pool.free(first)
    assert pool.release_idle(3600.0) == []  # not idle long enough
    assert pool.release_idle(0.0) == [MiB] and pool.regions == 1
    assert pool.allocate_growing(MiB, mapper) == 0  # the first region serves again


def test_a_header_sits_just_before_a_page_aligned_frame_after_the_owners_reserved_bytes() -> None:
    header, reserved = 64, 1000  # SharedMemoryConnector: slot headers, its key index and cells
    pool, mapper = SlotPool(MiB, ceiling=MiB + 3 * MiB, start=reserved), Mapper()
    small = pool.allocate(100, header=header)
    assert small == reserved  # small frames: 64-byte aligned, the header at the first free byte
    large = pool.allocate(100_000, header=header)
    assert (large + header) % PAGE == 0 and large > small  # the frame on a page, its header just before
    base, local, capacity = pool.locate(large)
    assert (base, local) == (0, large) and header + 100_000 <= capacity < header + 100_000 + PAGE
    # Growth takes only the room the ceiling leaves (3 MiB: less than a GROW_STEP), sized for the frame,
    # its header and alignment (a page more), rounded up to pages.
    grown = pool.allocate_growing(2 * MiB, mapper, header=header)
    assert grown is not None and mapper.mapped == [(MiB, 2 * MiB + 2 * PAGE)]
    assert (grown + header) % PAGE == 0 and pool.locate(grown)[:2] == (MiB, grown - MiB)
