"""The pure path decision: conditions, estimates and decide(), by examples and by properties."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edged.config import parse as parse_config
from edged.errors import ConfigError
from edged.routing import Decision, Estimates, Path, Policy, RouteRequest, Rule, decide
from edged.routing.conditions import VARIABLES, parse
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
    rule = Rule("local", task_type="text-classification", when=parse("local_load < 80%"),
                otherwise="cloud")  # fmt: skip
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
    d = decide(RouteRequest("m", deadline_s=0.3), Path(True, predicted_s=0.2), slow_cloud, {},
               policy)  # fmt: skip
    assert d.route == "local" and "only local fits" in d.reason
    # local over the threshold, cloud faster: cloud, with local as fallback
    d = decide(RouteRequest("m"), Path(True, predicted_s=0.2), FAST_CLOUD, {}, policy)
    assert (d.route, d.fallback) == ("cloud", "local")
    # local near the deadline: both
    d = decide(RouteRequest("m", deadline_s=0.25), Path(True, predicted_s=0.22), FAST_CLOUD, {},
               policy)  # fmt: skip
    assert d.route == "hedged"
    assert decide(RouteRequest("m", deadline_s=0.25), Path(True, predicted_s=0.22), FAST_CLOUD,
                  {}, Policy(hedging=False)).route == "cloud"  # fmt: skip
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
    d = decide(RouteRequest("m", deadline_s=deadline_s), Path(True, predicted_s=local_s),
               Path(True), {}, Policy())  # fmt: skip
    assert d.route == "cloud" and d.reason == (
        f"local estimate {local_s * 1000:.1f} ms {named} cloud not measured yet")  # fmt: skip


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
    from edged.router import local_reserve

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
    policy = Policy(rules=(Rule("cloud", when=parse("rtt > 1s"), name="slow-link"),
                           Rule("local", name="stay")))  # fmt: skip
    d = decide(RouteRequest("m"), Path(True, predicted_s=0.01), FAST_CLOUD, {"rtt": 0.02}, policy)
    assert d == Decision(
        "local", "rule 'stay': 'always' holds -> local", "cloud", 0.01, 0.01,
        FAST_CLOUD.predicted_s, 0.5, "rule", "rule 'stay'",
        ("rule 'slow-link': 'rtt > 1s' is false", "rule 'stay': 'always' is true",
         "-> local: rule 'stay': 'always' holds -> local"),
    )  # fmt: skip


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
    d = decide(RouteRequest("m", deadline_s=0.1), Path(True, predicted_s=0.3),
               Path(True, predicted_s=0.05), {}, policy)  # fmt: skip
    assert (d.route, d.fallback, d.predicted_s, d.basis, d.rule) == (
        "cloud", "local", 0.05, "rule", "rule 'keep-local'")  # fmt: skip
    assert d.reason == ("rule 'keep-local': 'always' holds -> local, but its estimate 300.0 ms"
                        " is over the deadline 100.0 ms and cloud may fit (50.0 ms)")  # fmt: skip
    # neither fits: the rule stands
    both_late = decide(RouteRequest("m", deadline_s=0.01), Path(True, predicted_s=0.3),
                       Path(True, predicted_s=0.05), {}, policy)  # fmt: skip
    assert (both_late.route, both_late.reason) == ("local", "rule 'keep-local': 'always' holds"
                                                   " -> local")  # fmt: skip


@pytest.mark.parametrize("override", ["local", "cloud", "hedged"])
def test_the_callers_override_is_the_route_with_every_field(override: str) -> None:
    local, cloud = Path(True, predicted_s=0.02), Path(True, predicted_s=0.04)
    d = decide(RouteRequest("m", override=override), local, cloud, {}, Policy())  # type: ignore[arg-type]
    predicted = {"local": 0.02, "cloud": 0.04, "hedged": 0.02}[override]
    fallback = {"local": "cloud", "cloud": "local", "hedged": None}[override]
    assert d == Decision(
        override, f"the request asked for {override}", fallback, predicted, 0.02, 0.04, 0.5,
        "request", None, (f"-> {override}: the request asked for {override}",),
    )  # type: ignore[arg-type]  # fmt: skip
