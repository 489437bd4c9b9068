"""The egress policy and secret models: rule grammar, decisions, the address refusal list, bad input.
Pure functions, no network: the whole file runs in well under a second."""

from __future__ import annotations

import ipaddress
import json

import pytest
from pydantic import ValidationError

from sandgate.egress.policy import EgressPolicy, refusal
from sandgate.egress.secrets import Secret, Secrets, placeholders
from pydantic import TypeAdapter

PUBLIC = [ipaddress.ip_address("93.184.215.14")]


def ips(*texts):
    return [ipaddress.ip_address(t) for t in texts]


def decide(policy, host, port=443, addresses=PUBLIC):
    return policy.decide(host, port, addresses)


# --- rules and decisions ------------------------------------------------------------------------

def test_default_deny_says_no_rule_matched():
    v = decide(EgressPolicy(), "api.example.com")
    assert not v.allowed and v.rule is None and v.reason == "no allow rule matched api.example.com:443"


def test_exact_host_matches_only_itself_case_and_trailing_dot_aside():
    p = EgressPolicy(allow=["api.example.com"])
    assert decide(p, "API.Example.com.").allowed
    assert decide(p, "api.example.com").address == "93.184.215.14"
    assert decide(p, "api.example.com").rule == "api.example.com"
    assert not decide(p, "x.api.example.com").allowed
    assert not decide(p, "example.com").allowed
    assert not decide(p, "api.example.com.evil.org").allowed


def test_wildcard_is_subdomains_only():
    p = EgressPolicy(allow=["*.example.org"])
    assert decide(p, "a.example.org").allowed
    assert decide(p, "a.b.example.org").allowed
    assert not decide(p, "example.org").allowed
    assert not decide(p, "badexample.org").allowed


def test_port_rules():
    p = EgressPolicy(allow=["api.example.com:443", "*.pypi.org:8443"])
    assert decide(p, "api.example.com", 443).allowed
    assert not decide(p, "api.example.com", 80).allowed
    assert decide(p, "files.pypi.org", 8443).allowed
    assert not decide(p, "files.pypi.org", 443).allowed


def test_deny_wins_over_allow_and_names_its_rule():
    p = EgressPolicy(allow=["*.example.org"], deny=["secret.example.org"])
    v = decide(p, "secret.example.org")
    assert not v.allowed and v.rule == "secret.example.org" and "secret.example.org" in v.reason
    assert decide(p, "public.example.org").allowed
    p = EgressPolicy(allow=["*.example.org"], deny=["*.example.org:80"])
    assert not decide(p, "a.example.org", 80).allowed and decide(p, "a.example.org", 443).allowed


def test_deny_by_address_after_resolution():
    p = EgressPolicy(allow=["*.example.org"], deny=["93.184.0.0/16"])
    v = decide(p, "a.example.org")
    assert not v.allowed and v.rule == "93.184.0.0/16" and "93.184.215.14" in v.reason


def test_cidr_allows_literal_addresses_in_it_on_its_port():
    p = EgressPolicy(allow=["10.0.0.0/8:443"])
    assert decide(p, "10.1.2.3", 443, ips("10.1.2.3")).allowed  # private, but named literally
    assert not decide(p, "10.1.2.3", 80, ips("10.1.2.3")).allowed
    assert not decide(p, "11.0.0.1", 443, ips("11.0.0.1")).allowed
    # a CIDR does not allow names: a name needs a host rule (so unallowed names are never resolved)
    assert not decide(p, "internal.corp", 443, ips("10.1.2.3")).allowed


def test_ipv6_rules_with_and_without_port():
    p = EgressPolicy(allow=["[2606:4700::/32]:443", "2a00:1450::1", "[2a00:1450::2]:80"])
    assert decide(p, "2606:4700::6810:84e5", 443, ips("2606:4700::6810:84e5")).allowed
    assert not decide(p, "2606:4700::6810:84e5", 80, ips("2606:4700::6810:84e5")).allowed
    assert decide(p, "[2a00:1450::1]", 8080, ips("2a00:1450::1")).allowed
    assert decide(p, "2a00:1450::2", 80, ips("2a00:1450::2")).allowed
    assert not decide(p, "2a00:1450::2", 443, ips("2a00:1450::2")).allowed


def test_name_check_comes_before_resolution():
    p = EgressPolicy(allow=["api.example.com"], deny=["bad.example.com"])
    assert not p.decide_name("exfil-data.attacker.org", 443).allowed
    assert not p.decide_name("bad.example.com", 443).allowed
    assert p.decide_name("api.example.com", 443).allowed


def test_a_name_without_addresses_is_refused():
    assert not decide(EgressPolicy(allow=["api.example.com"]), "api.example.com", 443, []).allowed


# --- addresses after resolution -----------------------------------------------------------------

REFUSED = {
    "10.1.2.3": "private", "172.16.0.1": "private", "192.168.1.1": "private", "127.0.0.1": "loopback",
    "127.9.9.9": "loopback", "0.0.0.0": "unspecified", "169.254.1.1": "link-local",
    "169.254.169.254": "metadata", "100.64.0.1": "carrier NAT", "224.0.0.1": "multicast",
    "255.255.255.255": "reserved", "198.18.0.1": "benchmarking", "::1": "loopback", "::": "unspecified",
    "fe80::1": "link-local", "fc00::1": "unique local", "fd00:ec2::254": "metadata", "ff02::1": "multicast",
    "::ffff:10.0.0.1": "private (as 10.0.0.1)", "::ffff:127.0.0.1": "loopback (as 127.0.0.1)",
    "::ffff:169.254.169.254": "metadata address (as 169.254.169.254)",
    "64:ff9b::a00:1": "private (as 10.0.0.1)", "64:ff9b::7f00:1": "loopback (as 127.0.0.1)",
    "64:ff9b:1::1": "local-use NAT64", "2002:a00:1::1": "private (as 10.0.0.1)",
    "2002:7f00:1::": "loopback (as 127.0.0.1)", "2001::a00:1": "Teredo", "::a00:1": "IPv4-compatible",
    "2001:db8::1": "documentation", "fec0::1": "site-local",
}


@pytest.mark.parametrize("text,why", sorted(REFUSED.items()))
def test_special_addresses_are_refused_with_a_reason(text, why):
    assert why in refusal(ipaddress.ip_address(text))
    v = decide(EgressPolicy(allow=["api.example.com"]), "api.example.com", 443, ips(text))
    assert not v.allowed and v.rule == "api.example.com" and why in v.reason


@pytest.mark.parametrize("text", ["93.184.215.14", "8.8.8.8", "2606:4700::1", "::ffff:8.8.8.8",
                                  "64:ff9b::808:808", "2002:808:808::1"])
def test_public_addresses_and_their_v6_forms_pass(text):
    assert refusal(ipaddress.ip_address(text)) is None


def test_one_bad_address_among_good_ones_refuses():
    v = decide(EgressPolicy(allow=["api.example.com"]), "api.example.com", 443, ips("8.8.8.8", "10.0.0.1"))
    assert not v.allowed and v.reason == "address 10.0.0.1 is private"


def test_an_allow_rule_naming_the_address_lifts_the_refusal():
    p = EgressPolicy(allow=["internal.corp", "10.0.0.0/8:443"])
    assert decide(p, "internal.corp", 443, ips("10.1.2.3")).allowed
    assert not decide(p, "internal.corp", 80, ips("10.1.2.3")).allowed  # the rule is for 443 only
    assert not decide(p, "internal.corp", 443, ips("192.168.0.1")).allowed


def test_metadata_needs_its_exact_address_named():
    wide = EgressPolicy(allow=["meta.corp", "169.254.0.0/16"])
    assert "metadata" in decide(wide, "meta.corp", 80, ips("169.254.169.254")).reason
    exact = EgressPolicy(allow=["meta.corp", "169.254.169.254"])
    assert decide(exact, "meta.corp", 80, ips("169.254.169.254")).allowed


# --- bad rules ----------------------------------------------------------------------------------

@pytest.mark.parametrize("rule", ["", "*", "*.", "**.example.org", "a.*.org", "exa mple.org", "-a.org",
                                  "api.example.com:0", "api.example.com:65536", "api.example.com:http",
                                  "10.0.0.1/8", "10.0.0.0/33", "300.1.1.1/8", "[2001:db8::/32]:x",
                                  "[nothost]:443", "münchen.de", "a" * 64 + ".org", "http://api.example.com"])
def test_bad_rules_are_validation_errors_naming_field_and_rule(rule):
    with pytest.raises(ValidationError) as e:
        EgressPolicy(allow=["ok.example.com", rule])
    err = e.value.errors()[0]
    assert err["loc"] == ("allow",)
    assert err["msg"].startswith("Value error, allow[1]: rule " + repr(rule))


def test_unknown_policy_fields_are_refused():
    with pytest.raises(ValidationError) as e:
        EgressPolicy.model_validate({"allow": [], "alow": ["x.org"]})
    assert e.value.errors()[0]["loc"] == ("alow",)


def test_policy_round_trips_as_the_create_body_shape():
    body = {"allow": ["api.example.com", "*.example.org", "10.0.0.0/8:443"], "deny": ["[::1]:80"]}
    assert json.loads(EgressPolicy.model_validate(body).model_dump_json()) == body


# --- secrets ------------------------------------------------------------------------------------

KEY = "Bearer sk-very-secret-0123456789"


def test_secret_value_is_write_only():
    s = Secret(host="API.example.com", header="Authorization", value=KEY, name="OPENAI_API_KEY")
    assert s.host == "api.example.com"
    for text in (repr(s), str(s), s.model_dump_json(), json.dumps(s.model_dump(), default=str)):
        assert "sk-very-secret" not in text


@pytest.mark.parametrize("body,field", [
    ({"host": "api.example.com", "header": "Bad Header", "value": KEY}, "header"),
    ({"host": "api.example.com", "header": "X:Y", "value": KEY}, "header"),
    ({"host": "api.example.com", "header": "Authorization", "value": KEY + "\r\nX: 1"}, "value"),
    ({"host": "api.example.com", "header": "Authorization", "value": ""}, "value"),
    ({"host": "not a host", "header": "Authorization", "value": KEY}, "host"),
    ({"host": "api.example.com", "value": KEY, "name": "1BAD"}, "name"),
    ({"host": "api.example.com", "header": "Authorization", "value": KEY, "extra": KEY}, "extra"),
])
def test_bad_secrets_name_the_field_and_never_echo_the_value(body, field):
    with pytest.raises(ValidationError) as e:
        Secret.model_validate(body)
    assert e.value.errors()[0]["loc"] == (field,)
    assert "sk-very-secret" not in str(e.value)
    # what the API's 400 is made of (api/base.py: loc and msg); errors() also carries the raw input,
    # which nothing may print
    assert all("sk-very-secret" not in err["msg"] for err in e.value.errors())


def test_a_secret_needs_a_header_or_a_name():
    with pytest.raises(ValidationError, match="a header, a name, or both"):
        Secret(host="api.example.com", value=KEY)


def test_a_secret_name_may_not_be_used_twice():
    twice = [{"host": "a.example.com", "value": "1", "name": "K"}, {"host": "b.example.com", "value": "2", "name": "K"}]
    with pytest.raises(ValidationError, match="'K' is used twice"):
        TypeAdapter(Secrets).validate_python(twice)


def test_secret_hosts_exact_or_wildcard():
    assert Secret(host="api.example.com", header="A", value="v").applies_to("API.example.com.")
    assert not Secret(host="api.example.com", header="A", value="v").applies_to("x.api.example.com")
    wild = Secret(host="*.example.com", header="A", value="v")
    assert wild.applies_to("api.example.com") and not wild.applies_to("example.com")
    assert not wild.applies_to("evilexample.com")


def test_placeholders_are_random_and_stable_given_the_record():
    secrets = [Secret(host="a.example.com", value="1", name="A_KEY"), Secret(host="b.example.com", header="X", value="2")]
    first = placeholders(secrets)
    assert list(first) == ["A_KEY"] and first["A_KEY"].startswith("sandgate-ph-") and len(first["A_KEY"]) == 44
    assert placeholders(secrets)["A_KEY"] != first["A_KEY"]
    assert placeholders(secrets, existing=first) == first
    assert placeholders(secrets[1:], existing=first) == {}
