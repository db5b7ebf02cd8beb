"""The scheduler and batchers on their own: batches fill, a lone image does not wait, images on their way are waited
for, results go to their own image; and the queue bound's places."""

import threading
import time

import pytest
import torch

from padim.models.scoring.model import ScoreOutput
from padim.models.scoring.verdicts import verdict
from padim.service.device.admission import LocalPlaces, SharedPlaces
from padim.service.device.batching import Batcher, Item, Scheduler, scored_images
from padim.service.edge.errors import ApiError


class Recorder:
    """Scores a batch as each image's sum, after ``seconds``; remembers the batch sizes."""

    def __init__(self, seconds: float = 0.01, fail=None):
        self.sizes: list[int] = []
        self.values: list[list[float]] = []
        self.seconds, self.fail = seconds, fail

    def __call__(self, batch: torch.Tensor) -> ScoreOutput:
        self.sizes.append(batch.shape[0])
        self.values.append(batch[:, 0, 0, 0].tolist())
        if self.fail is not None and self.fail(batch):
            raise ValueError("broken batch")
        time.sleep(self.seconds)
        raw = batch.flatten(1).sum(1)
        return ScoreOutput(raw, batch[:, 0], raw * 2)


def item(value: float, results: dict, key, keep_map: bool = False, threshold: float = 0.5) -> Item:
    done = threading.Event()
    results[key] = done

    def deliver(result):
        results[key] = result
        done.set()

    it = Item(torch.full((3, 2, 2), float(value)), threshold, keep_map, deliver)
    it.done = done  # type: ignore[attr-defined]
    return it


def wait_all(items, timeout=10.0) -> None:
    for it in items:
        assert it.done.wait(timeout)


@pytest.mark.load_sensitive
def test_concurrent_items_share_batches_and_keep_their_results():
    scheduler, score = Scheduler(), Recorder()
    batcher = Batcher(scheduler, score, max_batch_size=4, max_delay=0.05)
    results: dict = {}
    items = [item(i, results, i) for i in range(10)]
    batcher.put(items)
    wait_all(items)
    scheduler.stop()
    assert [results[i].raw_score for i in range(10)] == [12.0 * i for i in range(10)]
    assert [results[i].input_distance for i in range(10)] == [24.0 * i for i in range(10)]
    assert max(score.sizes) == 4 and sum(score.sizes) == 10 and len(score.sizes) == 3


@pytest.mark.load_sensitive
def test_a_lone_image_does_not_wait_for_company_that_is_not_coming():
    scheduler = Scheduler()
    batcher = Batcher(scheduler, Recorder(seconds=0), max_batch_size=32, max_delay=5.0)  # a wait would show
    results: dict = {}
    started = time.perf_counter()
    lone = item(1, results, "lone")
    batcher.put([lone])
    wait_all([lone])
    elapsed = time.perf_counter() - started
    scheduler.stop()
    assert elapsed < 2.0, f"a lone image waited {elapsed:.2f} s with nothing on its way"


@pytest.mark.load_sensitive
def test_images_on_their_way_are_waited_for_up_to_max_delay():
    scheduler, score = Scheduler(), Recorder(seconds=0)
    places = LocalPlaces(100)
    batcher = Batcher(scheduler, score, 8, max_delay=30.0, arriving=lambda: places.arriving("m"))
    results: dict = {}
    with places.admit("m", 3) as admission:  # three admitted, one decoded so far
        first = item(1, results, 0)
        admission.queued(1)
        batcher.put([first])
        time.sleep(0.3)
        assert not first.done.is_set(), "the batch left while two images were on their way"
        rest = [item(2, results, 1), item(3, results, 2)]
        admission.queued(2)
        batcher.put(rest)
        wait_all([first, *rest])
    scheduler.stop()
    assert score.sizes == [3]


def test_a_batch_stops_waiting_at_max_delay():
    scheduler, score = Scheduler(), Recorder(seconds=0)
    batcher = Batcher(scheduler, score, 8, max_delay=0.2, arriving=lambda: 1)  # one always said to be on its way
    results: dict = {}
    first = item(1, results, 0)
    batcher.put([first])
    wait_all([first])
    scheduler.stop()
    assert score.sizes == [1]


def test_a_full_batch_leaves_at_the_preferred_size_and_the_oldest_queue_goes_first():
    scheduler, score = Scheduler(), Recorder(seconds=0)
    hold = threading.Event()
    held = scheduler.call(lambda: hold.wait(10))  # the device is busy: queues fill
    a = Batcher(scheduler, score, 8, preferred_batch_size=2, name="a")
    b = Batcher(scheduler, score, 8, preferred_batch_size=2, name="b")
    results: dict = {}
    older = [item(2, results, f"b{i}") for i in range(3)]  # queued first, on b
    newer = [item(1, results, f"a{i}") for i in range(2)]
    a.put(newer)
    b.put(older)
    hold.set()
    held.result(10)
    wait_all(older + newer)
    scheduler.stop()
    assert score.values == [
        [2.0, 2.0],
        [2.0],
        [1.0, 1.0],
    ]  # b's images are older, whichever queue they share a batch in
    assert results["b2"].raw_score == 24.0 and results["a1"].raw_score == 12.0


def test_cancelled_items_are_skipped_and_failures_do_not_stop_the_scheduler():
    scheduler = Scheduler()
    score = Recorder(seconds=0, fail=lambda batch: bool((batch == 7).any()))
    batcher = Batcher(scheduler, score, 4)
    hold = threading.Event()
    scheduler.call(lambda: hold.wait(10))
    results: dict = {}
    gone, failing = item(1, results, "gone"), item(7, results, "failing")
    gone.cancelled = True
    batcher.put([gone, failing])
    hold.set()
    wait_all([failing])
    later = item(0, results, "later")
    batcher.put([later])
    wait_all([later])
    scheduler.stop()
    assert isinstance(results["failing"], ApiError) and results["failing"].code == "scoring_failed"
    assert isinstance(results["gone"], ApiError) and results["gone"].code == "client_disconnected"  # told, not scored
    assert results["later"].raw_score == 0.0
    assert score.sizes == [1, 1]


def test_a_closed_batcher_answers_what_it_held_and_what_comes_later_with_503():
    scheduler = Scheduler()
    hold = threading.Event()
    scheduler.call(lambda: hold.wait(10))
    batcher = Batcher(scheduler, Recorder(), 4)
    results: dict = {}
    queued = item(1, results, "queued")
    batcher.put([queued])
    batcher.close()
    late = item(1, results, "late")
    batcher.put([late])
    hold.set()
    scheduler.stop()
    for key in ("queued", "late"):
        assert isinstance(results[key], ApiError) and results[key].code == "shutting_down"


def test_what_a_batch_gives_back_makes_the_same_verdict_as_the_map():
    """Counted on the batch in float32 against each image's threshold: the pixels :func:`verdict` counts, including a
    threshold that lies between a pixel's float32 value and its float64 reading."""
    from padim.core.calibration import Calibration
    from padim.models.scoring.verdicts import verdict_of

    calibration = Calibration.from_scores(torch.linspace(0.5, 1.0, 50, dtype=torch.float64), false_alarm_rate=0.02)
    maps = torch.rand(4, 8, 8, generator=torch.Generator().manual_seed(0)) * 2
    maps[1, 0, 0] = torch.tensor(0.1, dtype=torch.float32)  # 0.1f is above 0.1 in float64
    maps[2, 3, 3] = float("nan")
    raw = maps.flatten(1).nan_to_num(0).amax(1)
    thresholds = [0.5, None, 0.5, 0.97]  # on the score scale, per image
    raw_thresholds = [calibration.raw_threshold(0.5 if t is None else t) for t in thresholds]
    raw_thresholds[1] = 0.1000000015  # rounds to 0.1f in float32, is above it in float64
    scored = scored_images(ScoreOutput(raw, maps, None), raw_thresholds, [False, True, False, False])
    assert scored[1].map is not None and torch.equal(scored[1].map, maps[1]) and scored[0].map is None
    assert not scored[2].finite and scored[0].finite and scored[3].finite
    for i in (0, 1, 3):
        assert scored[i].over == int((maps[i].numpy() >= raw_thresholds[i]).sum())
        assert scored[i].pixels == 64 and scored[i].raw_score == float(raw[i])
    assert scored[1].over >= 1  # the pixel at 0.1f is counted, as NumPy counts it
    for i in (0, 3):
        expected = verdict(float(raw[i]), maps[i], calibration, thresholds[i])
        got = verdict_of(scored[i].raw_score, scored[i].over, scored[i].pixels, True, calibration, thresholds[i])
        assert got == expected


def test_places_refuse_past_the_bound_and_come_back_when_a_request_ends():
    places = LocalPlaces(4)
    with places.admit("m", 3) as admission:
        with pytest.raises(ApiError) as refused:
            places.admit("m", 2)  # 3 taken + 2 > 4, though nothing is queued yet
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert refused.value.code == "overloaded"
        places.admit("other", 4).release()  # each model has its own bound
        admission.queued(2)
        assert (places.held("m"), places.arriving("m")) == (3, 1)
    assert (places.held("m"), places.arriving("m")) == (0, 0)


def test_shared_places_hold_across_processes_rows(tmp_path):
    """Two processes' rows of one table (here two handles, as two processes open it): the bound is global, each row
    is written by its owner only, and a row reset by a replacement gives its places back."""
    path = tmp_path / "places"
    SharedPlaces.create(path, rows=3)
    names = {"weave": 0, "carpet": 1}
    first = SharedPlaces(path, 3, 1, max_queue=5, index=names.__getitem__)
    second = SharedPlaces(path, 3, 2, max_queue=5, index=names.__getitem__)
    held = first.admit("weave", 3)
    with pytest.raises(ApiError):
        second.admit("weave", 3)  # 3 + 3 > 5 across the two rows
    taken = second.admit("weave", 2)
    taken.queued(2)
    assert (first.held("weave"), first.arriving("weave")) == (5, 3)
    assert second.held("carpet") == 0
    first.reset_row(1)  # the first row's process died; its replacement starts from zero
    assert (second.held("weave"), second.arriving("weave")) == (2, 0)
    taken.release()
    assert second.held("weave") == 0
    held.count = 0  # its row was reset: nothing of it is left to give back
    first.close()
    second.close()
