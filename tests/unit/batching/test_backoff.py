"""Out-of-memory backoff: N drops at once to what ran, grows back slowly, and a failed probe backs off."""

from worker.batching.scheduler import SizeLimit


def test_drops_to_the_largest_size_that_ran() -> None:
    limit = SizeLimit()
    limit.ran_out_of_memory(size=64, largest_ok=16)
    assert limit.cap == 16


def test_with_no_successful_split_it_halves() -> None:
    limit = SizeLimit()
    limit.ran_out_of_memory(size=64, largest_ok=0)
    assert limit.cap == 32


def test_grows_back_after_successes_and_returns_to_n() -> None:
    limit = SizeLimit(grow_after=3)
    limit.ran_out_of_memory(size=64, largest_ok=48)
    for _ in range(3):
        limit.succeeded(48, configured=64)
    assert limit.cap == 54
    for _ in range(3):
        limit.succeeded(54, configured=64)
    assert limit.cap == 60
    for _ in range(3):
        limit.succeeded(60, configured=64)
    assert limit.cap is None  # back to the configured N


def test_a_failed_probe_returns_to_the_proven_size_and_probes_less_often() -> None:
    limit = SizeLimit(grow_after=2)
    limit.ran_out_of_memory(size=64, largest_ok=16)
    limit.succeeded(16, configured=64)
    limit.succeeded(16, configured=64)
    assert limit.cap == 18
    limit.ran_out_of_memory(size=18, largest_ok=9)  # the probe split into halves of 9
    assert limit.cap == 16
    assert limit.grow_after == 4


def test_smaller_batches_do_not_count_towards_growth() -> None:
    limit = SizeLimit(grow_after=1)
    limit.ran_out_of_memory(size=64, largest_ok=16)
    limit.succeeded(3, configured=64)
    assert limit.cap == 16
