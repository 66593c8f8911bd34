"""Host order, slot assignment, host-change flags and the blacklist's cooldown with exponential backoff."""

from polytrain.launchers.elastic.hosts import (
    ADDED,
    REMOVED,
    Blacklist,
    Slot,
    assign_slots,
    host_change,
    order_hosts,
)


def test_survivors_keep_their_order_and_new_hosts_come_after():
    assert order_hosts(["d", "c", "b"], ["a", "b", "c"]) == ["b", "c", "d"]  # Horovod's unit test
    assert order_hosts(["127.0.0.1", "localhost"], ["localhost"]) == ["localhost", "127.0.0.1"]
    assert order_hosts(["x", "y"], []) == ["x", "y"]  # first discovery: as listed


def test_ranks_contiguous_per_host_up_to_max_np():
    slots = assign_slots(["a", "b"], {"a": 2, "b": 2})
    assert [(s.key, s.rank, s.size) for s in slots] == [("a:0", 0, 4), ("a:1", 1, 4), ("b:0", 2, 4), ("b:1", 3, 4)]
    assert [(s.local_size, s.cross_rank, s.cross_size) for s in slots] == [(2, 0, 2), (2, 0, 2), (2, 1, 2), (2, 1, 2)]
    capped = assign_slots(["a", "b"], {"a": 2, "b": 2}, max_np=3)  # the last host used in part
    assert [(s.key, s.rank, s.size, s.local_size) for s in capped] == [
        ("a:0", 0, 3, 2), ("a:1", 1, 3, 2), ("b:0", 2, 3, 1)]
    assert (capped[1].cross_rank, capped[1].cross_size) == (0, 1)  # no other host has a local rank 1
    after = assign_slots(["b"], {"a": 2, "b": 2})  # a blacklisted: b's workers renumbered, same local ranks
    assert [(s.key, s.rank, s.size) for s in after] == [("b:0", 0, 2), ("b:1", 1, 2)]
    assert Slot("h", 1, 3, 4, 2, 1, 2).horovod_env() == {
        "HOROVOD_HOSTNAME": "h", "HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2", "HOROVOD_CROSS_RANK": "1", "HOROVOD_CROSS_SIZE": "2"}


def test_host_change_flags():  # Horovod's sequence
    assert host_change({"a": 2}, {"a": 2, "b": 2}) == ADDED
    assert host_change({"a": 2, "b": 2}, {"b": 2}) == REMOVED
    assert host_change({"b": 2}, {"b": 1, "c": 1}) == REMOVED | ADDED
    assert host_change({"b": 1, "c": 1}, {"b": 1, "c": 1}) == 0
    assert host_change({"a": 1}, {"a": 3}) == ADDED


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_blacklist_for_good_without_a_cooldown():
    clock = Clock()
    out = Blacklist(None, clock=clock)
    assert out.add("a", "exit code 1") is None and out.is_out("a") and not out.is_out("b")
    clock.now += 10**6
    assert out.resurrect() == [] and out.is_out("a")


def test_cooldown_doubles_within_the_range_and_the_host_comes_back():
    clock = Clock()
    out = Blacklist((2, 100), clock=clock, uniform=lambda: 0.5)
    assert out.add("a", "exit code 1") == 2 * 2 + 0.5 * 2  # clamp(lo*2^n + U*lo, lo, hi), n = 1
    assert out.add("a", "again") == 5.0  # still cooling down: no new period, no backoff
    clock.now += 4.9
    assert out.resurrect() == [] and out.is_out("a")
    clock.now += 0.2
    assert out.resurrect() == ["a"] and not out.is_out("a")
    assert out.add("a", "exit code 1") == 2 * 4 + 1.0  # the second time: twice as long
    clock.now += 9.1
    assert out.resurrect() == ["a"]
    for _ in range(5):
        cooldown = out.add("a", "x")
        clock.now += cooldown + 0.01
        out.resurrect()
    assert cooldown == 100  # capped at MAX
    assert Blacklist((1, 2), clock=clock, uniform=lambda: 0.0).add("b", "x") == 2  # Horovod's test range: 2 s
