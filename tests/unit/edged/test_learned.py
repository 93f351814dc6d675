"""The learned routing policy on a clock the test moves: informed start, frugality, learning,
forgetting, and state that survives a restart."""

from __future__ import annotations

import random
from statistics import NormalDist

import pytest

from edged.routing.conditions import parse
from edged.routing.decide import Decision, Path, Policy, RouteRequest, Rule, decide
from edged.routing.learned import Learner, chance_within, slack_band


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


# ---- exact figures, on draws the test scripts (issue 32, second pass) -------------------------


class Draws(random.Random):
    """Thompson draws the test scripts, and the Beta posteriors they were asked from.

    The values come after construction: before 3.11 ``random.Random.__new__`` takes the
    constructor's arguments as a seed, a subclass's included (JetPack 6's Python is 3.10)."""

    def __init__(self) -> None:
        super().__init__(0)
        self.values: list[float] = []
        self.asked: list[tuple[float, float]] = []

    def betavariate(self, alpha: float, beta: float) -> float:
        self.asked.append((alpha, beta))
        return self.values.pop(0)


UNMEASURED = Path(True)  # the prior is even odds: Beta(6, 6) with the default weight
LIKELY = Path(True, predicted_s=0.02, deviation_s=0.002)  # about Beta(11, 1) at 100 ms
HOPELESS = Path(True, predicted_s=0.5, deviation_s=0.02)  # about Beta(1, 11) at 100 ms


def scripted(*values: float, **settings: float) -> tuple[Learner, Draws, Clock]:
    clock = Clock()
    learner = Learner(clock=clock, **settings)  # type: ignore[arg-type]
    draws = learner.random = Draws()
    draws.values = list(values)
    return learner, draws, clock


@pytest.mark.parametrize(
    ("deadline", "predicted", "band"),
    [
        (0.7, 1.0, 0),  # exactly on an edge: the band below
        (0.8, 1.0, 1),
        (1.0, 1.0, 1),
        (1.2, 1.0, 2),
        (1.4, 1.0, 2),
        (1.5, 1.0, 3),
        (1.0, 0.5, 3),  # deadline over the estimate, not times it
        (2.5, 1.0, 4),
        (0.1, 0.5, 0),
        (0.1, None, 5),  # unmeasured
        (0.1, 0.0, 5),  # no estimate worth the name
        (0.1, -1.0, 5),
    ],
)
def test_the_slack_band_is_the_deadline_over_the_estimate(
    deadline: float, predicted: float | None, band: int
) -> None:
    assert slack_band(deadline, predicted) == band


@pytest.mark.parametrize(
    ("deadline", "path", "mean", "sigma"),
    [
        (0.125, Path(True, predicted_s=0.12, deviation_s=0.02), 0.1, 0.025),  # 1.25 deviations
        (0.09, Path(True, predicted_s=0.12, deviation_s=0.02), 0.1, 0.025),
        (0.21, Path(True, predicted_s=0.2), 0.2, 0.01),  # no deviation: 5% of the mean
        (0.21, Path(True, predicted_s=0.2, deviation_s=0.0), 0.2, 0.01),
        (0.0002, Path(True, predicted_s=0.0001), 0.0001, 0.0001),  # at least 0.1 ms
        (0.00005, Path(True, predicted_s=0.0), 0.0, 0.0001),
    ],
)
def test_the_prior_is_a_normal_around_the_estimate(
    deadline: float, path: Path, mean: float, sigma: float
) -> None:
    assert chance_within(deadline, path) == pytest.approx(NormalDist(mean, sigma).cdf(deadline))


def test_a_draw_exactly_good_enough_keeps_the_device_and_asks_nothing_of_the_cloud() -> None:
    learner, draws, _ = scripted(0.9)
    assert learner.choose(REQUEST, UNMEASURED, LIKELY, 0.1) == (
        "local",
        "learned: P(in time) drawn local 0.90, good enough",
    )
    assert draws.asked == [(6.0, 6.0)]  # one draw, from the even prior


def test_a_device_likely_in_time_stays_local_whatever_the_draw() -> None:
    learner, draws, _ = scripted(0.1)
    assert learner.choose(REQUEST, LIKELY, LIKELY, 0.1) == (
        "local",
        "learned: P(in time) drawn local 0.10, good enough",
    )
    assert len(draws.asked) == 1


@pytest.mark.parametrize(
    ("mine", "theirs", "route"),
    [
        (0.25, 0.5, "cloud"),  # even odds are enough
        (0.375, 0.5, "local"),  # exactly the margin better is not clearly better
        (0.25, 0.49, "local"),  # clearly better, but under even odds
        (0.5, 0.55, "local"),  # over even odds, but not by the margin
        (0.5, 0.75, "cloud"),
    ],
)
def test_the_cloud_must_be_likely_and_clearly_likelier_than_the_device(
    mine: float, theirs: float, route: str
) -> None:
    learner, draws, _ = scripted(mine, theirs, cost_margin=0.125)
    tier, reason = learner.choose(REQUEST, UNMEASURED, LIKELY, 0.1)
    assert (tier, reason) == (
        route,
        f"learned: P(in time) drawn local {mine:.2f}, cloud {theirs:.2f}",
    )
    assert draws.asked[0] == (6.0, 6.0) and len(draws.asked) == 2


def test_each_tier_draws_from_its_own_evidence() -> None:
    learner, draws, _ = scripted(0.1, 0.8)
    for _ in range(5):
        learner.learn(REQUEST, "cloud", UNMEASURED, 0.1, in_time=False)
    for _ in range(3):
        learner.learn(REQUEST, "local", UNMEASURED, 0.1, in_time=True)
    tier, reason = learner.choose(REQUEST, UNMEASURED, UNMEASURED, 0.1)
    assert draws.asked == [(9.0, 6.0), (6.0, 11.0)]
    # believed 6/17, under even odds: a hunch
    assert (tier, reason) == (
        "cloud",
        "learned: P(in time) drawn local 0.10, cloud 0.80 (exploring)",
    )


def test_a_hunch_goes_to_the_cloud_once_per_interval_per_model() -> None:
    learner, _, clock = scripted(*[0.1, 0.8] * 5)
    hunch = "learned: P(in time) drawn local 0.10, cloud 0.80"
    assert learner.choose(REQUEST, HOPELESS, HOPELESS, 0.1) == ("cloud", hunch + " (exploring)")
    assert learner.choose(REQUEST, HOPELESS, HOPELESS, 0.1) == (
        "local",
        hunch + " (exploration spent)",
    )
    clock.now = 9.5
    assert learner.choose(REQUEST, HOPELESS, HOPELESS, 0.1)[0] == "local"
    other = RouteRequest("n", deadline_s=0.1)  # another model has its own ration
    assert learner.choose(other, HOPELESS, HOPELESS, 0.1) == ("cloud", hunch + " (exploring)")
    clock.now = 10.0  # the default interval, 10 s, has passed
    assert learner.choose(REQUEST, HOPELESS, HOPELESS, 0.1) == ("cloud", hunch + " (exploring)")


def test_even_odds_for_the_cloud_are_not_a_hunch() -> None:
    learner, _, _ = scripted(0.1, 0.8, 0.1, 0.8)
    for _ in range(2):  # not rationed
        assert learner.choose(REQUEST, HOPELESS, UNMEASURED, 0.1) == (
            "cloud",
            "learned: P(in time) drawn local 0.10, cloud 0.80",
        )


def test_the_posterior_is_the_prior_plus_evidence_faded_by_its_half_life() -> None:
    learner, _, clock = scripted()
    key = learner.key(REQUEST, "local", UNMEASURED, 0.1)
    assert key == ("m", "local", 5)
    assert learner.posterior(key, 0.1, UNMEASURED) == (6.0, 6.0)  # weight 10, even odds
    clock.now = 30.0
    for in_time in (True, True, True, True, False, False):
        learner.learn(REQUEST, "local", UNMEASURED, 0.1, in_time=in_time)
    assert learner.posterior(key, 0.1, UNMEASURED) == (10.0, 8.0)
    clock.now = 60.0  # one half-life (30 s by default) later
    assert learner.posterior(key, 0.1, UNMEASURED) == (8.0, 7.0)
    clock.now = 90.0
    assert learner.posterior(key, 0.1, UNMEASURED) == (7.0, 6.5)


def test_learning_fades_the_old_evidence_before_adding_the_new() -> None:
    learner, _, clock = scripted(half_life_s=10.0)
    measured = Path(True, predicted_s=0.05)  # slack 2: band 3
    for now, in_time in ((0.0, True), (10.0, False), (20.0, True)):
        clock.now = now
        learner.learn(REQUEST, "local", measured, 0.1, in_time=in_time)
    # [1, 0] -> [0.5, 1] -> [1.25, 0.5]
    assert learner.to_json() == {"rows": [["m", "local", 3, 1.25, 0.5, 0.0]]}


def test_the_state_keeps_ages_across_a_restart() -> None:
    learner, _, clock = scripted()
    clock.now = 10.0
    learner.learn(REQUEST, "cloud", UNMEASURED, 0.1, in_time=True)
    clock.now = 15.0
    doc = learner.to_json()
    assert doc == {"rows": [["m", "cloud", 5, 1.0, 0.0, 5.0]]}
    restarted, _, later = scripted()
    later.now = 100.0
    restarted.load_json(doc)
    assert restarted.to_json() == doc
    later.now = 125.0  # 30 s after it was learned: half of it is left
    assert restarted.posterior(("m", "cloud", 5), 0.1, UNMEASURED) == (6.5, 6.0)
    restarted.load_json({})
    assert restarted.table == {} and restarted.to_json() == {"rows": []}


def test_a_seed_makes_the_draws_repeatable() -> None:
    def reasons(seed: int) -> list[str]:
        learner = Learner(seed=seed, clock=Clock())
        return [learner.choose(REQUEST, UNMEASURED, UNMEASURED, 0.1)[1] for _ in range(20)]

    assert reasons(5) == reasons(5)
    assert reasons(5) != reasons(6)


def test_refine_puts_the_learners_choice_in_every_field_and_keeps_the_rules_trace() -> None:
    local, cloud = Path(True, predicted_s=0.3), Path(True, predicted_s=0.03)
    policy = Policy(rules=(Rule("cloud", when=parse("gpu > 90%")), Rule("auto")))
    decision = decide(REQUEST, local, cloud, {"gpu": 10.0}, policy)
    assert decision.route == "cloud" and len(decision.trace) == 3
    learner, _, _ = scripted(0.95)
    why = "learned: P(in time) drawn local 0.95, good enough"
    assert learner.refine(decision, REQUEST, local, cloud) == Decision(
        "local",
        why,
        "cloud",
        0.3,
        0.3,
        0.03,
        0.1,
        "learned",
        None,
        ("rule 1: 'gpu > 90%' is false", "rule 2: 'always' is true", f"-> local: {why}"),
    )


def test_refine_can_send_to_the_cloud_what_the_cost_model_kept_local() -> None:
    decision = decide(REQUEST, UNMEASURED, LIKELY, {}, Policy())
    assert decision.route == "local"  # no local estimate yet
    learner, _, _ = scripted(0.1, 0.8)
    why = "learned: P(in time) drawn local 0.10, cloud 0.80"
    assert learner.refine(decision, REQUEST, UNMEASURED, LIKELY) == Decision(
        "cloud", why, "local", 0.02, None, 0.02, 0.1, "learned", None, (f"-> cloud: {why}",)
    )
