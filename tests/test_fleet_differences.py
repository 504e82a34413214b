"""daemon/server/fleet_differences.py: the fields in which the replicas behind kvd router differ,
and how `kvctl status` at the router says so (kvctl/software_status.py). The router's own
`/admin/status` over real replicas is in test_router.py."""

from __future__ import annotations

from rich.console import Console

from kvctl.daemon.server.fleet_differences import FIELDS, fleet_differences
from kvctl.fleet_status import render_fleet_status
from kvctl.software_status import difference_line, software_line

SOFTWARE = {"kvd": "0.1.0", "python": "3.11.9", "torch": "2.13.0+cu128", "cuda": "12.8", "triton": "3.9.0",
            "tokenizers": "0.23.3", "llguidance": "1.9.1"}


def replica(model="llama-8b", revision="a" * 64, software=None, **model_fields) -> dict:
    return {"software": {**SOFTWARE, **(software or {})},
            "model": {"name": model, "revision": revision, "dtype": "torch.bfloat16", "max_model_len": 8192,
                      "chat_template": {"digest": "c" * 64}, "sampling_defaults": {"values": {"temperature": 0.6}},
                      **model_fields},
            "cache": {"dtype": "fp8_e4m3"}}


def test_replicas_that_agree_have_no_difference_and_one_replica_none():
    assert fleet_differences([("a", replica()), ("b", replica()), ("c", replica())]) == []
    assert fleet_differences([("a", replica(software={"torch": "2.12.0"}))]) == []
    assert fleet_differences([]) == []


def test_a_software_difference_is_named_across_models_with_the_most_held_value_first():
    found = fleet_differences([("a", replica(software={"torch": "2.12.0+cu126"})), ("b", replica()),
                               ("c", replica(model="qwen-7b", revision="b" * 64))])
    assert found == [{"field": "software.torch", "label": "torch build",
                      "why": "a request may take other tokens on each, seeded or greedy", "model": None,
                      "values": [{"value": "2.13.0+cu128", "replicas": ["b", "c"]},
                                 {"value": "2.12.0+cu126", "replicas": ["a"]}],
                      "held": "2.13.0+cu128 on b, c; 2.12.0+cu126 on a"}]


def test_a_models_weights_and_formats_are_compared_among_its_own_replicas_only():
    """qwen's other revision is no difference: it is another model. Within llama, b holds other
    weights and c another cache format, another template, no sampling defaults and a shorter context."""
    c = replica(max_model_len=4096, chat_template={"digest": "d" * 64}, sampling_defaults={"values": {}})
    c["cache"]["dtype"] = "int8"
    found = fleet_differences([("a", replica()), ("b", replica(revision="b" * 64)), ("c", c),
                               ("q", replica(model="qwen-7b", revision="e" * 64))])
    assert [(d["field"], d["label"], d["model"], [(v["value"], v["replicas"]) for v in d["values"]])
            for d in found] == [
        ("model.revision", "checkpoint revision of llama-8b", "llama-8b", [("a" * 12, ["a", "c"]), ("b" * 12, ["b"])]),
        ("cache.dtype", "cache format of llama-8b", "llama-8b", [("fp8_e4m3", ["a", "b"]), ("int8", ["c"])]),
        ("model.chat_template.digest", "chat template of llama-8b", "llama-8b",
         [("c" * 12, ["a", "b"]), ("d" * 12, ["c"])]),
        ("model.sampling_defaults.values", "sampling defaults of llama-8b", "llama-8b",
         [("temperature 0.6", ["a", "b"]), ("none", ["c"])]),
        ("model.max_model_len", "context limit of llama-8b", "llama-8b",
         [("8,192 tokens", ["a", "b"]), ("4,096 tokens", ["c"])])]
    # with one model served, its name is not repeated in each label
    alone = fleet_differences([("a", replica()), ("b", replica(revision="b" * 64))])
    assert [d["label"] for d in alone] == ["checkpoint revision"]


def test_an_older_kvd_that_does_not_say_and_a_library_not_installed_are_values_of_their_own():
    old = replica()
    del old["software"]
    found = fleet_differences([("a", replica(software={"llguidance": None})), ("b", replica()), ("c", old)])
    by_field = {d["field"]: [(v["value"], v["replicas"]) for v in d["values"]] for d in found}
    assert by_field == {
        **{f.key: [(SOFTWARE[f.key.split(".")[1]], ["a", "b"]), ("not said (an older kvd)", ["c"])]
           for f in FIELDS if f.key.startswith("software.") and f.key != "software.llguidance"},
        "software.llguidance": [("1.9.1", ["b"]), ("not installed", ["a"]), ("not said (an older kvd)", ["c"])]}


def test_kvctl_says_what_software_a_kvd_runs_and_where_the_fleet_differs():
    assert software_line(SOFTWARE) == ("kvd 0.1.0 on Python 3.11.9: torch 2.13.0+cu128 (CUDA 12.8), triton 3.9.0, "
                                       "tokenizers 0.23.3, llguidance 1.9.1")
    assert software_line({**SOFTWARE, "torch": "2.13.0+cpu", "cuda": None, "triton": None, "llguidance": None}) == \
        "kvd 0.1.0 on Python 3.11.9: torch 2.13.0+cpu, tokenizers 0.23.3"
    [difference] = fleet_differences([("/run/kvd-0/kvd.sock", replica()),
                                      ("/run/kvd-1/kvd.sock", replica(software={"kvd": "0.2.0"})),
                                      ("/run/kvd-2/kvd.sock", replica(software={"kvd": "0.2.0"}))])
    assert difference_line(difference).plain == (
        "replicas differ in kvd version (a request may take other tokens on each, seeded or greedy): 0.2.0 on "
        "/run/kvd-1/kvd.sock, /run/kvd-2/kvd.sock; 0.1.0 on /run/kvd-0/kvd.sock")
    live = {"blocks": {"device": {"total": 64, "free": 64}}, "tokens": {"prompt": 0, "hit": 0, "hit_ratio": 0.0},
            "queue": {"waiting": 0, "running": 0}}
    data = {"routing": "prefix", "replicas": [], "differences": [difference],
            "replica_status": [{"replica": f"/run/kvd-{i}/kvd.sock", **live} for i in range(3)]}
    console = Console(record=True, width=200)
    render_fleet_status(data, console)
    assert difference_line(difference).plain in console.export_text()
    quiet = Console(record=True, width=200)
    render_fleet_status({**data, "differences": []}, quiet)
    assert "differ" not in quiet.export_text()
