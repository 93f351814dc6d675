"""The learned routing policy on a clock the test moves: informed start, frugality, learning,
forgetting, and state that survives a restart."""

from __future__ import annotations

from edged.routing import Path, Policy, RouteRequest, decide
from edged.routing.learned import Learner, chance_within


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


REQUEST = RouteRequest("m", deadline_s=0.1)


def share_cloud(learner: Learner, local: Path, cloud: Path, n: int = 400) -> float:
    return sum(learner.choose(REQUEST, local, cloud, 0.1)[0] == "cloud" for _ in range(n)) / n


def test_the_estimate_is_the_prior() -> None:
    assert chance_within(0.1, Path(True, predicted_s=0.05, deviation_s=0.005)) > 0.999
    assert chance_within(0.1, Path(True, predicted_s=0.2, deviation_s=0.01)) < 0.001
    assert chance_within(0.1, Path(True)) == 0.5  # unmeasured


def test_frugal_local_when_the_device_makes_it_cloud_when_only_it_does() -> None:
    learner = Learner(seed=1, clock=Clock())
    fast_local = Path(True, predicted_s=0.02, deviation_s=0.002)
    slow_local = Path(True, predicted_s=0.3, deviation_s=0.02)
    cloud = Path(True, predicted_s=0.03, deviation_s=0.003)
    assert share_cloud(learner, fast_local, cloud) < 0.01  # no cloud call it does not need
    assert share_cloud(learner, slow_local, cloud) > 0.95
    hopeless = Path(True, predicted_s=0.5, deviation_s=0.02)
    assert share_cloud(learner, slow_local, hopeless) < 0.05  # the cloud must likely help


def test_it_learns_that_an_estimate_is_wrong_and_forgets_in_time() -> None:
    clock = Clock()
    learner = Learner(seed=2, clock=clock)
    local = Path(True, predicted_s=0.06, deviation_s=0.01)  # the estimate says: in time
    cloud = Path(True, predicted_s=0.03, deviation_s=0.003)
    assert share_cloud(learner, local, cloud) < 0.2
    for _ in range(40):  # but the device keeps missing the deadline
        learner.learn(REQUEST, "local", local, 0.1, in_time=False)
    assert share_cloud(learner, local, cloud) > 0.9
    clock.now += 300  # ten half-lives later the evidence has faded: back to the estimate
    assert share_cloud(learner, local, cloud) < 0.2


def test_refine_keeps_privacy_and_rules_and_the_state_survives_a_restart() -> None:
    learner = Learner(seed=3, clock=Clock())
    local = Path(True, predicted_s=0.3, deviation_s=0.02)
    cloud = Path(True, predicted_s=0.03, deviation_s=0.003)
    private = RouteRequest("m", private=True, deadline_s=0.1)
    kept = decide(private, local, cloud, {}, Policy())
    assert learner.refine(kept, private, local, cloud) is kept  # private: not the learner's
    chosen = learner.refine(decide(REQUEST, local, cloud, {}, Policy()), REQUEST, local, cloud)
    assert chosen.basis == "learned" and chosen.route == "cloud" and chosen.fallback == "local"
    assert chosen.reason.startswith("learned:") and chosen.trace[-1].startswith("-> cloud")
    learner.learn(REQUEST, "cloud", cloud, 0.1, in_time=True)
    restarted = Learner(clock=Clock())
    restarted.load_json(learner.to_json())
    assert restarted.table.keys() == learner.table.keys()
    (row,) = restarted.table.values()
    assert row[:2] == [1.0, 0.0]


def test_exploration_on_a_hunch_is_rationed() -> None:
    clock = Clock()
    learner = Learner(seed=4, clock=clock, explore_every_s=10.0)
    hopeless_local = Path(True, predicted_s=0.5, deviation_s=0.02)
    doubtful_cloud = Path(True, predicted_s=0.116, deviation_s=0.01)  # about 1 chance in 3
    assert share_cloud(learner, hopeless_local, doubtful_cloud, n=200) == 1 / 200  # one hunch
    clock.now += 10.0
    assert share_cloud(learner, hopeless_local, doubtful_cloud, n=200) == 1 / 200  # one more
    likely_cloud = Path(True, predicted_s=0.05, deviation_s=0.005)  # not a hunch: no ration
    assert share_cloud(learner, hopeless_local, likely_cloud, n=200) > 0.95
