"""The pure path decision: conditions, estimates and decide(), by examples and by properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.common.errors import ConfigError
from edged.config import parse as parse_config
from edged.routing.conditions import VARIABLES, parse
from edged.routing.decide import Decision, Path, Policy, RouteRequest, Rule, decide
from edged.routing.estimates import Estimates, load_band, size_band
from tests.conftest import examples

# ---- conditions -----------------------------------------------------------------------------


def test_condition_units_and_precedence() -> None:
    cond = parse("local_load < 80% and rtt > 0.15s or payload >= 1MB")
    assert cond.holds({"local_load": 50, "rtt": 200.0, "payload": 0})
    assert not cond.holds({"local_load": 90, "rtt": 200.0, "payload": 10})
    assert cond.holds({"local_load": 90, "rtt": 1.0, "payload": 1e6})
    assert parse("payload > 1KiB").any_of[0][0].value == 1024
    assert parse("temperature >= 70C").holds({"temperature": 71.5})


def test_unknown_values_never_make_a_condition_true() -> None:
    assert not parse("gpu < 50%").holds({"gpu": None})
    assert not parse("gpu >= 50%").holds({})
    assert parse("gpu < 50% or cpu < 50%").holds({"gpu": None, "cpu": 10})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "empty"),
        ("load < 80%", "unknown variable 'load'"),
        ("rtt < 80%", "'rtt' takes the units ms, s"),
        ("local_load < eighty", "cannot read"),
        ("local_load < 80% and", "cannot read"),
        ("__import__('os') < 1", "cannot read"),
    ],
)
def test_bad_conditions_say_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse(text)


def test_a_bad_rule_in_the_config_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"routing\.rules\.0\.when.*unknown variable 'lod'"):
        parse_config({"routing": {"rules": [{"when": "lod < 80%", "action": "local"}]}})
    config = parse_config(
        {"routing": {"rules": [{"task_type": "t", "when": "cpu < 80%", "action": "cloud"}]}}
    )
    (rule,) = config.routing.to_policy().rules
    assert rule.task_type == "t" and rule.when is not None and rule.when.text == "cpu < 80%"


# ---- decide() by example --------------------------------------------------------------------

UP = Path(True, predicted_s=0.01)
FAST_CLOUD = Path(True, predicted_s=0.02)


def test_private_input_stays_local_even_against_a_rule_and_an_override() -> None:
    policy = Policy(rules=(Rule("cloud"),))
    request = RouteRequest("m", private=True, override="cloud")
    decision = decide(request, UP, FAST_CLOUD, {}, policy)
    assert decision.route == "local" and decision.basis == "private"
    assert decision.fallback is None  # not even as a fallback
    assert decide(request, Path(False, "not loaded"), FAST_CLOUD, {}, policy).route == "none"


def test_the_brief_rule_local_under_80_percent_else_cloud() -> None:
    rule = Rule(
        "local", task_type="text-classification", when=parse("local_load < 80%"), otherwise="cloud"
    )
    policy = Policy(rules=(rule,))
    request = RouteRequest("m", task_type="text-classification")
    calm = decide(request, UP, FAST_CLOUD, {"local_load": 30.0}, policy)
    busy = decide(request, UP, FAST_CLOUD, {"local_load": 95.0}, policy)
    assert (calm.route, busy.route) == ("local", "cloud")
    assert "does not hold" in busy.reason and busy.rule == "rule 1" and busy.fallback == "local"
    other = decide(RouteRequest("m", task_type="ocr"), UP, FAST_CLOUD, {"local_load": 95}, policy)
    assert other.rule is None  # the rule is for another task type


def test_cost_model_deadline_threshold_and_hedging() -> None:
    policy = Policy()
    slow_cloud = Path(True, predicted_s=0.45)
    # local over the threshold, the cloud does not fit a 300 ms deadline: local
    d = decide(
        RouteRequest("m", deadline_s=0.3), Path(True, predicted_s=0.2), slow_cloud, {}, policy
    )
    assert d.route == "local" and "only local fits" in d.reason
    # local over the threshold, cloud faster: cloud, with local as fallback
    d = decide(RouteRequest("m"), Path(True, predicted_s=0.2), FAST_CLOUD, {}, policy)
    assert (d.route, d.fallback) == ("cloud", "local")
    # local near the deadline: both
    d = decide(
        RouteRequest("m", deadline_s=0.25), Path(True, predicted_s=0.22), FAST_CLOUD, {}, policy
    )
    assert d.route == "hedged"
    assert (
        decide(
            RouteRequest("m", deadline_s=0.25),
            Path(True, predicted_s=0.22),
            FAST_CLOUD,
            {},
            Policy(hedging=False),
        ).route
        == "cloud"
    )
    # a cloud cost weight tips a close call to the device
    costly = Path(True, predicted_s=0.15, cost=1.0)
    assert decide(RouteRequest("m"), Path(True, predicted_s=0.2), costly, {}, policy).route == (
        "cloud"
    )
    weighted = Policy(cloud_cost_weight_s=0.1)
    assert decide(RouteRequest("m"), Path(True, predicted_s=0.2), costly, {}, weighted).route == (
        "local"
    )


@pytest.mark.parametrize(
    ("local_s", "deadline_s", "named"),
    [
        (0.0123, 0.012, "over the deadline 12.0 ms;"),  # within the threshold: the deadline
        (0.2, 0.5, "over the local threshold 100.0 ms;"),
        (0.2, 0.15, "over the local threshold 100.0 ms and the deadline 150.0 ms;"),
    ],
)
def test_the_reason_names_the_limit_that_decided(
    local_s: float, deadline_s: float, named: str
) -> None:
    """With the cloud not measured yet, the reason said "over the local threshold 100.0 ms"
    for a 12.3 ms estimate against a 12 ms deadline (issue 31)."""
    d = decide(
        RouteRequest("m", deadline_s=deadline_s),
        Path(True, predicted_s=local_s),
        Path(True),
        {},
        Policy(),
    )
    assert d.route == "cloud" and d.reason == (
        f"local estimate {local_s * 1000:.1f} ms {named} cloud not measured yet"
    )


# ---- decide() by property -------------------------------------------------------------------

seconds = st.one_of(st.none(), st.floats(0, 5, allow_nan=False))
paths = st.builds(
    Path,
    available=st.booleans(),
    why_not=st.sampled_from(["", "down", "not loaded"]),
    predicted_s=seconds,
    cost=st.floats(0, 10, allow_nan=False),
)
conditions = st.sampled_from(
    ["local_load < 80%", "rtt > 150ms", "payload >= 1MB and gpu < 50%", "deadline < 100ms"]
).map(parse)
actions = st.sampled_from(["local", "cloud", "auto"])
rules = st.builds(
    Rule,
    action=actions,
    task_type=st.sampled_from([None, "a", "b"]),
    model=st.sampled_from([None, "m", "n"]),
    when=st.one_of(st.none(), conditions),
    otherwise=st.one_of(st.none(), actions),
)
policies = st.builds(
    Policy,
    rules=st.lists(rules, max_size=4).map(tuple),
    default_deadline_s=st.floats(0.001, 5),
    local_threshold_s=st.floats(0.001, 1),
    cloud_cost_weight_s=st.floats(0, 1),
    hedging=st.booleans(),
    hedge_margin=st.floats(0, 1),
)
requests = st.builds(
    RouteRequest,
    model=st.sampled_from(["m", "n"]),
    task_type=st.sampled_from([None, "a", "b"]),
    private=st.booleans(),
    deadline_s=seconds,
    payload_bytes=st.integers(0, 10**8),
    override=st.sampled_from([None, "local", "cloud", "hedged"]),
)
facts = st.fixed_dictionaries(
    {name: st.one_of(st.none(), st.floats(0, 10**7, allow_nan=False)) for name in VARIABLES}
)


@settings(max_examples=examples(3000), deadline=None)
@given(requests, paths, paths, facts, policies)
def test_decide_properties(
    request: RouteRequest, local: Path, cloud: Path, facts: dict[str, float | None], policy: Policy
) -> None:
    decision = decide(request, local, cloud, facts, policy)
    assert decision.reason  # always a reason
    assert decision.trace and decision.trace[-1].startswith(f"-> {decision.route}")
    uses_cloud = decision.route in ("cloud", "hedged") or decision.fallback == "cloud"
    uses_local = decision.route in ("local", "hedged") or decision.fallback == "local"
    if request.private:  # never private to the cloud, not even as fallback
        assert not uses_cloud
    if not cloud.available:  # never an unavailable tier
        assert not uses_cloud
    if not local.available:
        assert not uses_local
    if decision.route == "none":
        assert not local.available and (not cloud.available or request.private)
    else:  # something that can serve is always chosen
        assert local.available or (cloud.available and not request.private)
    assert decide(request, local, cloud, facts, policy) == decision  # pure


# ---- estimates ------------------------------------------------------------------------------


def test_estimates_learn_per_band_and_follow_the_link() -> None:
    est = Estimates(alpha=0.5, spread=0.0)
    assert est.predict("m", "local") is None
    for _ in range(10):
        est.observe("m", "local", 0.010, load=10)
        est.observe("m", "local", 0.050, load=90)
    assert est.predict("m", "local", load=5) == pytest.approx(0.010)
    assert est.predict("m", "local", load=99) == pytest.approx(0.050)
    assert est.predict("m", "local", load=60) == pytest.approx(0.050)  # nearest band measured
    # the cloud learns service time; the prediction adds today's RTT and transfer
    est.observe("m", "cloud", 0.030, payload=100, rtt=0.020)
    assert est.predict("m", "cloud", payload=100, rtt=0.400) == pytest.approx(0.410)
    assert est.predict("m", "cloud", payload=100, rtt=0.0, bandwidth=100.0) == pytest.approx(1.01)


def test_a_bad_cloud_url_is_a_config_error() -> None:
    for url, message in [
        ("ftp://x", "must be http"),
        ("gw.example.com/api", "must be http"),
        ("grpcs://h:443/prefix", "no path prefix"),
    ]:
        with pytest.raises(ConfigError, match=rf"cloud\.url: .*{message}"):
            parse_config({"cloud": {"url": url}})
    assert parse_config({"cloud": {"url": "https://gw:8443/api/v1"}}).cloud.url


def test_the_local_reserve_of_a_cloud_call() -> None:
    from edged.routing.router import local_reserve

    def cloud(local: float | None, deadline: float, fallback: bool = True) -> Decision:
        return Decision("cloud", "r", "local" if fallback else None, None, local, 0.01, deadline)

    assert local_reserve(cloud(0.001, 0.5)) == 0.02  # at least 20 ms
    assert local_reserve(cloud(0.05, 0.5)) == 0.1  # twice the local estimate
    assert local_reserve(cloud(0.005, 0.02)) == 0.01  # at most half the deadline
    assert local_reserve(cloud(0.03, 0.025)) == 0.0  # local would miss anyway: all to the cloud
    assert local_reserve(cloud(0.001, 0.5, fallback=False)) == 0.0


# ---- the survivors of mutation testing (issue 32), each killed here --------------------------


def test_a_false_rule_without_otherwise_passes_to_the_next_rule() -> None:
    """(``continue`` -> ``break``): the second rule still decides."""
    policy = Policy(
        rules=(Rule("cloud", when=parse("rtt > 1s"), name="slow-link"), Rule("local", name="stay"))
    )
    d = decide(RouteRequest("m"), Path(True, predicted_s=0.01), FAST_CLOUD, {"rtt": 0.02}, policy)
    assert d == Decision(
        "local",
        "rule 'stay': 'always' holds -> local",
        "cloud",
        0.01,
        0.01,
        FAST_CLOUD.predicted_s,
        0.5,
        "rule",
        "rule 'stay'",
        (
            "rule 'slow-link': 'rtt > 1s' is false",
            "rule 'stay': 'always' is true",
            "-> local: rule 'stay': 'always' holds -> local",
        ),
    )


def test_a_rule_for_one_model_applies_to_that_model_only() -> None:
    """(``==`` -> ``!=`` in ``Rule.applies_to``)."""
    policy = Policy(rules=(Rule("cloud", model="ocr", name="ocr-to-cloud"),))
    here = Path(True, predicted_s=0.01)
    assert decide(RouteRequest("ocr"), here, FAST_CLOUD, {}, policy).rule == "rule 'ocr-to-cloud'"
    other = decide(RouteRequest("intent"), here, FAST_CLOUD, {}, policy)
    assert (other.route, other.basis, other.rule) == ("local", "estimate", None)
    typed = Policy(rules=(Rule("cloud", task_type="ocr"),))
    assert decide(RouteRequest("x", task_type="ocr"), here, FAST_CLOUD, {}, typed).route == "cloud"
    assert decide(RouteRequest("x", task_type="asr"), here, FAST_CLOUD, {}, typed).route == "local"


def test_a_rule_whose_tier_misses_the_deadline_gives_way_to_the_other() -> None:
    policy = Policy(rules=(Rule("local", name="keep-local"),))
    d = decide(
        RouteRequest("m", deadline_s=0.1),
        Path(True, predicted_s=0.3),
        Path(True, predicted_s=0.05),
        {},
        policy,
    )
    assert (d.route, d.fallback, d.predicted_s, d.basis, d.rule) == (
        "cloud",
        "local",
        0.05,
        "rule",
        "rule 'keep-local'",
    )
    assert d.reason == (
        "rule 'keep-local': 'always' holds -> local, but its estimate 300.0 ms"
        " is over the deadline 100.0 ms and cloud may fit (50.0 ms)"
    )
    # neither fits: the rule stands
    both_late = decide(
        RouteRequest("m", deadline_s=0.01),
        Path(True, predicted_s=0.3),
        Path(True, predicted_s=0.05),
        {},
        policy,
    )
    assert (both_late.route, both_late.reason) == (
        "local",
        "rule 'keep-local': 'always' holds -> local",
    )


@pytest.mark.parametrize("override", ["local", "cloud", "hedged"])
def test_the_callers_override_is_the_route_with_every_field(override: str) -> None:
    local, cloud = Path(True, predicted_s=0.02), Path(True, predicted_s=0.04)
    d = decide(RouteRequest("m", override=override), local, cloud, {}, Policy())  # type: ignore[arg-type]
    predicted = {"local": 0.02, "cloud": 0.04, "hedged": 0.02}[override]
    fallback = {"local": "cloud", "cloud": "local", "hedged": None}[override]
    assert d == Decision(
        override,
        f"the request asked for {override}",
        fallback,
        predicted,
        0.02,
        0.04,
        0.5,
        "request",
        None,
        (f"-> {override}: the request asked for {override}",),
    )  # type: ignore[arg-type]


# ---- decide(): every field of every branch (issue 32, second pass) ---------------------------


def test_when_no_tier_can_serve_the_route_is_none_with_both_reasons() -> None:
    local = Path(False, "not loaded", predicted_s=0.01)
    cloud = Path(False, "link down", predicted_s=0.02)
    d = decide(RouteRequest("m"), local, cloud, {}, Policy())
    why = "no tier can serve: local not loaded; cloud link down"
    assert d == Decision(
        "none",
        why,
        None,
        None,
        0.01,
        0.02,
        0.5,
        "unavailable",
        None,
        ("cloud excluded: link down", "local excluded: not loaded", f"-> none: {why}"),
    )
    private = decide(RouteRequest("m", private=True), local, FAST_CLOUD, {}, Policy())
    assert private.reason == "no tier can serve: local not loaded; cloud the input is private"
    assert private.trace[0] == "cloud excluded: the input is private"


def test_only_the_cloud_serves_when_the_device_cannot() -> None:
    d = decide(
        RouteRequest("m", deadline_s=0.3),
        Path(False, "not loaded"),
        FAST_CLOUD,
        {},
        Policy(rules=(Rule("local"),)),
    )
    why = "only the cloud can serve: local not loaded"
    assert d == Decision(
        "cloud",
        why,
        None,
        0.02,
        None,
        0.02,
        0.3,
        "unavailable",
        None,
        ("local excluded: not loaded", f"-> cloud: {why}"),
    )


@pytest.mark.parametrize(("private", "basis"), [(False, "unavailable"), (True, "private")])
def test_without_the_cloud_the_device_serves_and_says_why(private: bool, basis: str) -> None:
    cloud = Path(False, "circuit open", predicted_s=0.02) if not private else FAST_CLOUD
    why = "cloud excluded: " + ("the input is private" if private else "circuit open")
    d = decide(
        RouteRequest("m", private=private),
        Path(True, predicted_s=0.3),
        cloud,
        {},
        Policy(default_deadline_s=0.25),
    )
    assert d == Decision(
        "local",
        why,
        None,
        0.3,
        0.3,
        0.02,
        0.25,
        basis,
        None,
        (why, f"-> local: {why}"),
    )


@pytest.mark.parametrize(
    ("local_s", "cloud_s", "predicted"),
    [(0.02, None, 0.02), (None, 0.04, 0.04), (None, None, None), (0.05, 0.03, 0.03)],
)
def test_a_hedged_call_is_predicted_at_the_faster_measured_tier(
    local_s: float | None, cloud_s: float | None, predicted: float | None
) -> None:
    d = decide(
        RouteRequest("m", override="hedged"),
        Path(True, predicted_s=local_s),
        Path(True, predicted_s=cloud_s),
        {},
        Policy(),
    )
    assert (d.route, d.predicted_s, d.fallback) == ("hedged", predicted, None)


def test_a_rule_that_holds_sends_the_request_with_every_field() -> None:
    rule = Rule("cloud", when=parse("rtt < 50ms"), otherwise="local")
    d = decide(
        RouteRequest("m", deadline_s=0.25), UP, FAST_CLOUD, {"rtt": 20.0}, Policy(rules=(rule,))
    )
    why = "rule 1: 'rtt < 50ms' holds -> cloud"
    assert d == Decision(
        "cloud",
        why,
        "local",
        0.02,
        0.01,
        0.02,
        0.25,
        "rule",
        "rule 1",
        ("rule 1: 'rtt < 50ms' is true", f"-> cloud: {why}"),
    )
    slow = decide(
        RouteRequest("m", deadline_s=0.25), UP, FAST_CLOUD, {"rtt": 80.0}, Policy(rules=(rule,))
    )
    assert (slow.route, slow.reason, slow.fallback, slow.trace[0]) == (
        "local",
        "rule 1: 'rtt < 50ms' does not hold -> local",
        "cloud",
        "rule 1: 'rtt < 50ms' is false",
    )


def test_unnamed_rules_are_numbered_from_one_in_their_order() -> None:
    policy = Policy(
        rules=(Rule("cloud", model="other"), Rule("local", when=parse("gpu > 90%")), Rule("cloud"))
    )
    d = decide(RouteRequest("m"), UP, FAST_CLOUD, {"gpu": 10.0}, policy)
    assert (d.route, d.rule, d.reason) == ("cloud", "rule 3", "rule 3: 'always' holds -> cloud")
    assert d.trace == (
        "rule 2: 'gpu > 90%' is false",
        "rule 3: 'always' is true",
        "-> cloud: rule 3: 'always' holds -> cloud",
    )


def test_a_rule_needs_both_its_task_type_and_its_model_to_match() -> None:
    policy = Policy(rules=(Rule("cloud", task_type="ocr", model="m"),))
    for request in (
        RouteRequest("n", task_type="ocr"),
        RouteRequest("m", task_type="asr"),
        RouteRequest("m"),
    ):
        assert decide(request, UP, FAST_CLOUD, {}, policy).basis == "estimate"
    assert decide(RouteRequest("m", task_type="ocr"), UP, FAST_CLOUD, {}, policy).route == "cloud"


def test_an_auto_rule_hands_the_choice_to_the_cost_model_and_ends_the_rules() -> None:
    policy = Policy(
        rules=(
            Rule("auto", when=parse("cpu < 50%"), otherwise="auto", name="a"),
            Rule("cloud", name="later"),
        )
    )
    for cpu in (10.0, 90.0):
        d = decide(RouteRequest("m"), UP, FAST_CLOUD, {"cpu": cpu}, policy)
        assert (d.route, d.basis, d.rule) == ("local", "estimate", None)
        assert d.trace[0] == f"rule 'a': 'cpu < 50%' is {'true' if cpu < 50 else 'false'}"
        assert len(d.trace) == 2


@pytest.mark.parametrize(
    ("action", "local_s", "cloud_s", "route"),
    [
        ("local", 0.125, 0.0625, "local"),  # on the deadline: it fits, the rule stands
        ("local", 0.25, 0.125, "cloud"),  # the other tier exactly on the deadline fits
        ("local", 0.25, 0.25, "local"),  # neither fits: the rule stands
        ("cloud", 0.0625, 0.25, "local"),
        ("cloud", 0.0625, None, "cloud"),  # not measured: not over
        ("local", None, 0.0625, "local"),
    ],
)
def test_a_rule_gives_way_only_when_its_tier_is_over_and_the_other_fits(
    action: str, local_s: float | None, cloud_s: float | None, route: str
) -> None:
    policy = Policy(rules=(Rule(action, name="r"),))  # type: ignore[arg-type]
    d = decide(
        RouteRequest("m", deadline_s=0.125),
        Path(True, predicted_s=local_s),
        Path(True, predicted_s=cloud_s),
        {},
        policy,
    )
    assert (d.route, d.basis, d.rule) == (route, "rule", "rule 'r'")
    assert d.predicted_s == (local_s if route == "local" else cloud_s)
    assert d.fallback == ("cloud" if route == "local" else "local")
    assert d.reason.startswith(f"rule 'r': 'always' holds -> {action}")
    assert ("but its estimate" in d.reason) == (route != action)


def test_a_rule_gives_way_to_an_unmeasured_tier_and_says_so() -> None:
    d = decide(
        RouteRequest("m", deadline_s=0.125),
        Path(True),
        Path(True, predicted_s=0.5),
        {},
        Policy(rules=(Rule("cloud", name="r"),)),
    )
    assert d.route == "local" and d.reason == (
        "rule 'r': 'always' holds -> cloud, but its estimate 500.0 ms is over the deadline"
        " 125.0 ms and local may fit (unmeasured)"
    )


def test_with_no_local_estimate_the_device_goes_first() -> None:
    why = "no local estimate yet: the device goes first"
    d = decide(RouteRequest("m"), Path(True), FAST_CLOUD, {}, Policy())
    assert d == Decision(
        "local", why, "cloud", None, None, 0.02, 0.5, "estimate", None, (f"-> local: {why}",)
    )


@pytest.mark.parametrize(("local_s", "deadline_s"), [(0.125, 0.5), (0.0625, 0.0625)])
def test_local_within_the_threshold_and_the_deadline_stays_local_at_the_limits(
    local_s: float, deadline_s: float
) -> None:
    policy = Policy(local_threshold_s=0.125)
    d = decide(
        RouteRequest("m", deadline_s=deadline_s),
        Path(True, predicted_s=local_s),
        Path(True, predicted_s=0.03125),
        {},
        policy,
    )
    why = f"local estimate {local_s * 1000:.1f} ms within the local threshold 125.0 ms"
    assert d == Decision(
        "local",
        why,
        "cloud",
        local_s,
        local_s,
        0.03125,
        deadline_s,
        "estimate",
        None,
        (f"-> local: {why}",),
    )


@pytest.mark.parametrize(
    ("local_s", "deadline_s", "named"),
    [
        (0.125, 0.0625, "the deadline 62.5 ms"),  # on the threshold: only the deadline
        (0.25, 0.25, "the local threshold 125.0 ms"),  # on the deadline: only the threshold
    ],
)
def test_a_limit_the_estimate_is_exactly_on_is_not_named(
    local_s: float, deadline_s: float, named: str
) -> None:
    d = decide(
        RouteRequest("m", deadline_s=deadline_s),
        Path(True, predicted_s=local_s),
        Path(True),
        {},
        Policy(local_threshold_s=0.125),
    )
    why = f"local estimate {local_s * 1000:.1f} ms over {named}; cloud not measured yet"
    assert d == Decision(
        "cloud",
        why,
        "local",
        None,
        local_s,
        None,
        deadline_s,
        "estimate",
        None,
        (f"-> cloud: {why}",),
    )


def test_hedging_runs_both_with_every_field() -> None:
    d = decide(
        RouteRequest("m", deadline_s=0.5),
        Path(True, predicted_s=0.5),
        Path(True, predicted_s=0.25),
        {},
        Policy(hedge_margin=0.25),
    )
    why = (
        "local estimate 500.0 ms close to the deadline 500.0 ms, cloud 250.0 ms:"
        " both run, the first answer wins"
    )
    assert d == Decision(
        "hedged", why, None, 0.25, 0.5, 0.25, 0.5, "estimate", None, (f"-> hedged: {why}",)
    )


@pytest.mark.parametrize(
    ("local_s", "cloud_s", "route"),
    [
        (0.375, 0.25, "cloud"),  # exactly (1 - margin) * deadline: not close, cloud is faster
        (0.376, 0.25, "hedged"),
        (0.376, 0.5, "hedged"),  # the cloud on the deadline still fits
        (0.376, 0.501, "local"),  # the cloud would miss it: only local fits
        (0.501, 0.25, "cloud"),  # local past the deadline: not a hedge
    ],
)
def test_hedging_needs_local_close_to_the_deadline_and_the_cloud_within_it(
    local_s: float, cloud_s: float, route: str
) -> None:
    policy = Policy(hedge_margin=0.25)
    d = decide(
        RouteRequest("m", deadline_s=0.5),
        Path(True, predicted_s=local_s),
        Path(True, predicted_s=cloud_s),
        {},
        policy,
    )
    assert (d.route, d.basis) == (route, "estimate")
    unhedged = decide(
        RouteRequest("m", deadline_s=0.5),
        Path(True, predicted_s=local_s),
        Path(True, predicted_s=cloud_s),
        {},
        Policy(hedging=False),
    )
    assert unhedged.route != "hedged"


@pytest.mark.parametrize(
    ("local_s", "cloud_s", "reason"),
    [
        (0.5, 0.75, "only local fits the deadline 500.0 ms (local 500.0 ms, cloud 750.0 ms)"),
        (0.75, 0.5, "only cloud fits the deadline 500.0 ms (local 750.0 ms, cloud 500.0 ms)"),
        (0.25, 0.25, "local is faster: local 250.0 ms, cloud 250.0 ms (both fit"),
        (0.25, 0.125, "cloud is faster: local 250.0 ms, cloud 125.0 ms (both fit"),
        (0.75, 1.0, "local is faster: local 750.0 ms, cloud 1000.0 ms (neither fits"),
        (1.0, 0.75, "cloud is faster: local 1000.0 ms, cloud 750.0 ms (neither fits"),
    ],
)
def test_the_cost_model_names_the_winner_and_the_figures(
    local_s: float, cloud_s: float, reason: str
) -> None:
    if not reason.startswith("only"):
        reason += " the deadline 500.0 ms)"
    route = reason.split()[1] if reason.startswith("only") else reason.split()[0]
    fallback = "cloud" if route == "local" else "local"
    predicted = local_s if route == "local" else cloud_s
    d = decide(
        RouteRequest("m"),
        Path(True, predicted_s=local_s),
        Path(True, predicted_s=cloud_s),
        {},
        Policy(hedging=False),
    )
    assert d == Decision(
        route,
        reason,
        fallback,
        predicted,
        local_s,
        cloud_s,
        0.5,
        "estimate",
        None,  # type: ignore[arg-type]
        (f"-> {route}: {reason}",),
    )


def test_the_cloud_cost_weight_adds_seconds_to_the_cloud_and_is_named() -> None:
    cloud = Path(True, predicted_s=0.125, cost=0.5)
    policy = Policy(cloud_cost_weight_s=0.25, hedging=False)
    tie = decide(RouteRequest("m"), Path(True, predicted_s=0.25), cloud, {}, policy)
    assert (tie.route, tie.reason) == (
        "local",
        "local is faster: local 250.0 ms, cloud 125.0 ms + cost 0.125 s"
        " (both fit the deadline 500.0 ms)",
    )
    d = decide(RouteRequest("m"), Path(True, predicted_s=0.3), cloud, {}, policy)
    assert (d.route, d.predicted_s) == ("cloud", 0.125)
    assert d.reason == (
        "cloud is faster: local 300.0 ms, cloud 125.0 ms + cost 0.125 s"
        " (both fit the deadline 500.0 ms)"
    )


# ---- conditions: the messages and the units, exactly ------------------------------------------


def test_a_bad_condition_names_every_known_variable_and_the_allowed_units() -> None:
    known = ", ".join(VARIABLES)
    assert known.startswith("local_load, cpu, gpu")
    with pytest.raises(ValueError) as unknown:
        parse("load < 80%")
    assert str(unknown.value) == f"unknown variable 'load'; known: {known}"
    with pytest.raises(ValueError) as unitless:
        parse("queue > 3ms")
    assert str(unitless.value) == "'queue' takes the units none, not 'ms'"
    with pytest.raises(ValueError) as unreadable:
        parse("  local_load < eighty ")
    assert str(unreadable.value) == (
        "cannot read 'local_load < eighty': write <variable> <op> <number>[unit],"
        " e.g. 'local_load < 80%'"
    )
    with pytest.raises(ValueError) as empty:
        parse("   ")
    assert str(empty.value) == "the condition is empty"


@pytest.mark.parametrize(
    ("text", "variable", "value"),
    [
        ("queue > 3", "queue", 3.0),  # no unit: the number as written
        ("local_load < 80", "local_load", 80.0),
        ("rtt > 0.25s", "rtt", 250.0),
        ("deadline <= 40ms", "deadline", 40.0),
        ("payload >= 2kb", "payload", 2000.0),
        ("payload >= 3MB", "payload", 3e6),
        ("payload >= 1MiB", "payload", 1024.0**2),
        ("battery != 15%", "battery", 15.0),
    ],
)
def test_a_number_is_kept_in_its_variables_base_unit(
    text: str, variable: str, value: float
) -> None:
    ((comparison,),) = parse(text).any_of
    assert (comparison.variable, comparison.value) == (variable, value)


def test_and_and_or_are_read_in_any_case() -> None:
    cond = parse("cpu < 10% AND gpu < 10% Or rtt > 1s")
    assert [[c.variable for c in group] for group in cond.any_of] == [["cpu", "gpu"], ["rtt"]]
    assert cond.holds({"rtt": 2000.0}) and not cond.holds({"cpu": 5.0, "gpu": 50.0})
    assert cond.variables() == {"cpu", "gpu", "rtt"}


# ---- estimates: the bands, the arithmetic and the table ---------------------------------------


@pytest.mark.parametrize(
    ("load", "band"),
    [
        (None, 0),
        (-5.0, 0),
        (0.0, 0),
        (24.9, 0),
        (25.0, 1),
        (49.9, 1),
        (50.0, 2),
        (74.9, 2),
        (75.0, 3),
        (80.0, 3),
        (100.0, 3),
        (250.0, 3),
    ],
)
def test_the_load_bands_are_quarters_and_clamped(load: float | None, band: int) -> None:
    assert load_band(load) == band


@pytest.mark.parametrize(
    ("payload", "band"),
    [
        (0, 0),
        (1, 0),
        (3, 0),
        (4, 1),
        (15, 1),
        (16, 2),
        (63, 2),
        (64, 3),
        (4**8 - 1, 7),
        (4**8, 8),
        (10**6, 9),
    ],
)
def test_the_size_bands_are_powers_of_four(payload: int, band: int) -> None:
    assert size_band(payload) == band


def test_the_default_estimate_is_an_ewma_plus_one_deviation() -> None:
    est = Estimates()  # alpha 0.2, spread 1
    est.observe("m", "local", 0.1)
    est.observe("m", "local", 0.2)
    # deviation 0.2 * |0.2 - 0.1| = 0.02; mean 0.1 + 0.2 * 0.1 = 0.12
    assert est.forecast("m", "local") == pytest.approx((0.14, 0.02))
    assert est.predict("m", "local") == pytest.approx(0.14)


def test_the_deviation_is_measured_against_the_mean_before_the_update() -> None:
    est = Estimates(alpha=0.5, spread=2.0)
    for seconds in (0.1, 0.3, 0.2):
        est.observe("m", "local", seconds)
    # after 0.3: deviation 0.1, mean 0.2; after 0.2: deviation 0.05, mean 0.2
    assert est.forecast("m", "local") == pytest.approx((0.3, 0.05))
    assert est.summary("m", "local") == pytest.approx((0.2, 3))


def test_the_cloud_learns_service_time_and_the_device_does_not_subtract_rtt() -> None:
    est = Estimates(alpha=0.5, spread=0.0)
    est.observe("m", "local", 0.05, rtt=0.02)
    assert est.predict("m", "local") == pytest.approx(0.05)
    est.observe("m", "cloud", 0.01, rtt=0.02)  # faster than the RTT: service time 0, not less
    assert est.predict("m", "cloud") == 0.0
    assert est.predict("m", "cloud", rtt=0.03) == pytest.approx(0.03)
    assert est.predict("m", "cloud", bandwidth=10.0) == 0.0  # no payload, no transfer
    assert est.forecast("m", "cloud", bandwidth=10.0) == (0.0, 0.0)


def test_the_spread_adds_deviations_on_both_paths() -> None:
    est = Estimates(alpha=0.5, spread=2.0)
    est.observe("m", "cloud", 0.1)
    est.observe("m", "cloud", 0.3)  # deviation 0.1, mean 0.2
    assert est.predict("m", "cloud", rtt=0.05) == pytest.approx(0.45)
    assert est.forecast("m", "cloud", payload=64, bandwidth=640.0) == pytest.approx((0.5, 0.1))


def test_the_cloud_is_one_band_whatever_the_load() -> None:
    est = Estimates(alpha=0.5, spread=0.0)
    est.observe("m", "cloud", 0.1, load=90.0)
    est.observe("m", "cloud", 0.2, load=10.0)
    assert len(est.as_list()) == 1 and est.summary("m", "cloud") == pytest.approx((0.15, 2))


def test_an_estimate_belongs_to_its_model_and_path() -> None:
    est = Estimates(spread=0.0)
    est.observe("m", "local", 0.1)
    assert est.predict("n", "local") is None and est.predict("m", "cloud") is None
    assert est.summary("n", "local") is None and est.summary("m", "cloud") is None


def test_an_unseen_band_borrows_from_the_nearest_load_first_then_size() -> None:
    est = Estimates(spread=0.0)
    est.observe("m", "local", 0.5, load=30.0, payload=4**8)  # load band 1, size band 8
    est.observe("m", "local", 0.1, load=10.0, payload=0)  # load band 0, size band 0
    # from (0, 8): (1, 8) and (0, 0) are both 8 away (a load band weighs 8 size bands): the
    # first measured wins
    assert est.predict("m", "local", load=10.0, payload=4**8) == 0.5
    # from (2, 0): (1, 8) is 8 + 8 away, (0, 0) 16 + 0: the first measured again
    assert est.predict("m", "local", load=60.0, payload=0) == 0.5
    est.observe("m", "local", 0.3, load=10.0, payload=4**5)  # (0, 5)
    assert est.predict("m", "local", load=10.0, payload=4**3) == 0.3  # 2 size bands, not 3
    assert est.predict("m", "local", load=10.0, payload=4**2) == 0.1  # 2, not 3
    # the same load band 6 size bands away beats another load band 2 size bands away
    assert est.predict("m", "local", load=30.0, payload=4**2) == 0.5


def test_the_summary_weighs_each_band_by_its_calls() -> None:
    est = Estimates(alpha=0.5, spread=0.0)
    for _ in range(3):
        est.observe("m", "local", 0.1, load=10.0)
    est.observe("m", "local", 0.5, load=90.0)
    est.observe("n", "local", 9.0)
    est.observe("m", "cloud", 9.0)
    mean, count = est.summary("m", "local")  # type: ignore[misc]
    assert (mean, count) == (pytest.approx(0.2), 4)


def test_the_table_lists_every_band_sorted_with_readable_bands() -> None:
    est = Estimates(alpha=0.5)
    est.observe("m", "local", 0.0123456, load=60.0, payload=20)
    est.observe("m", "local", 0.0335802, load=60.0, payload=20)
    est.observe("m", "cloud", 0.04, payload=0, rtt=0.01)
    est.observe("a", "local", 0.001, load=None)
    assert est.as_list() == [
        {
            "model": "a",
            "path": "local",
            "load_band": "0-25%",
            "size_band": "<4 B",
            "mean_ms": 1.0,
            "deviation_ms": 0.0,
            "count": 1,
        },
        {
            "model": "m",
            "path": "cloud",
            "load_band": None,
            "size_band": "<4 B",
            "mean_ms": 30.0,
            "deviation_ms": 0.0,
            "count": 1,
        },
        {
            "model": "m",
            "path": "local",
            "load_band": "50-75%",
            "size_band": "<64 B",
            "mean_ms": 22.963,
            "deviation_ms": 10.617,
            "count": 2,
        },
    ]
    assert Estimates().as_list() == []


def test_a_servers_figure_over_many_calls_teaches_as_that_many_calls() -> None:
    one_by_one, at_once = Estimates(), Estimates()
    for est in (one_by_one, at_once):
        est.observe("m", "cloud", 0.01)
    for _ in range(5):
        one_by_one.observe("m", "cloud", 0.25)
    at_once.observe("m", "cloud", 0.25, times=5)  # a read of the server's statistics
    assert at_once.lookup("m", "cloud", None, 0).mean == pytest.approx(  # type: ignore[union-attr]
        one_by_one.lookup("m", "cloud", None, 0).mean  # type: ignore[union-attr]
    )
    assert at_once.summary("m", "cloud") == pytest.approx((0.25 - 0.24 * 0.8**5, 6))
    fresh = Estimates()
    fresh.observe("m", "cloud", 0.3, times=40)  # a prior from the server's whole history
    assert fresh.summary("m", "cloud") == pytest.approx((0.3, 40))


def test_every_cloud_tier_learns_its_service_time_net_of_the_rtt() -> None:
    for path in ("cloud", "cloud:spot"):
        est = Estimates()
        est.observe("m", path, 0.15, rtt=0.1)  # 50 ms of service
        # now the link is quicker: the forecast follows the RTT of now
        assert est.predict("m", path, rtt=0.02) == pytest.approx(0.07), path
