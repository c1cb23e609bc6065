"""The block cache's auto policy: groups, the cost model's choices, the check that reverts
a plan, and the decision as a journaled update a restarted master keeps."""
from __future__ import annotations

from remoteloader.core.cache.segments import BlockSigner
from remoteloader.core.cache.store import BlockStore
from remoteloader.master.cache_plan import CachePlanner
from remoteloader.master.cache_policy import MIN_ROWS, Measured, PlanCheck, choose, feature_groups
from remoteloader.master.journal import Journal
from remoteloader.master.service import MasterConfig, MasterService
from remoteloader.spec import DatasetSpec
from remoteloader.transforms import compile_features
from tests.conftest import spec_dict
from tests.test_master_service import Clock, call, heartbeat, hello, register, session

SCHEMA = {"a": "id_list", "b": "id_list", "c": "id_list", "x": "float"}


class F:  # a FeatureSpec's shape
    def __init__(self, name, column=None, inputs=(), transforms=()):
        self.name, self.column, self.inputs, self.transforms = name, column, tuple(inputs), tuple(transforms)
        self.scores = self.default = None


def test_features_sharing_a_column_form_one_group():
    pipeline = compile_features(
        [F("dx", "x")],
        [F("a1", "a"), F("a2", "a", transforms=[{"op": "firstx", "x": 2}]), F("b1", "b"),
         F("ab", inputs=["a1", "b1"], transforms=[{"op": "id_list_intersect"}]), F("c1", "c")], SCHEMA)
    groups = {g.name: (set(g.features), set(g.columns)) for g in feature_groups(pipeline)}
    assert groups == {"dx": ({"dx"}, {"x"}), "a1": ({"a1", "a2", "b1", "ab"}, {"a", "b"}), "c1": ({"c1"}, {"c"})}


def measured(decode_s: float, transform_s: float, nbytes: float, read_bps: float, write_bps: float,
             rows: int = MIN_ROWS) -> Measured:
    """One group "g" (feature g, column c): seconds and bytes a row."""
    return Measured({"c": [rows, decode_s * rows, nbytes * rows]}, {"g": [rows, transform_s * rows, nbytes * rows]},
                    read_bps, write_bps)


def group():
    pipeline = compile_features([], [F("g", "c", transforms=[{"op": "firstx", "x": 3}])], {"c": "id_list"})
    return feature_groups(pipeline)


def test_a_heavy_spec_on_a_fast_cache_caches_transformed_blocks():
    (choice,) = choose(group(), measured(2e-6, 20e-6, 40, 1e9, 5e8), {"g": 2}, 1_000_000, None)
    assert choice.mode == "transformed" and choice.final and "saves" in choice.reason


def test_a_light_spec_on_a_slow_cache_computes():
    (choice,) = choose(group(), measured(0.2e-6, 0.1e-6, 40, 20e6, 20e6), {"g": 2}, 1_000_000, None)
    assert choice.mode == "compute" and choice.final and "would not pay" in choice.reason


def test_no_later_read_means_compute_and_unmeasured_means_undecided():
    (last_epoch,) = choose(group(), measured(2e-6, 20e-6, 40, 1e9, 5e8), {"g": 0}, 1_000_000, None)
    assert last_epoch.mode == "compute" and last_epoch.final
    (early,) = choose(group(), measured(2e-6, 20e-6, 40, 1e9, 5e8, rows=10), {"g": 2}, 1_000_000, None)
    assert early.mode == "compute" and not early.final
    (no_rates,) = choose(group(), measured(2e-6, 20e-6, 40, None, None), {"g": 2}, 1_000_000, None)
    assert not no_rates.final


def test_the_budget_and_a_revert_keep_a_group_computing():
    m = measured(2e-6, 20e-6, 40, 1e9, 5e8)
    (over,) = choose(group(), m, {"g": 2}, 1_000_000, budget_bytes=1000)
    assert over.mode == "compute" and "budget" in over.reason
    (reverted,) = choose(group(), m, {"g": 2}, 1_000_000, None, frozenset({"g"}))
    assert reverted.mode == "compute" and "reverted" in reverted.reason


def test_the_check_reverts_a_plan_that_made_reading_epochs_slower():
    check = PlanCheck(("g",), epoch=0, baseline_s=10e-6)
    assert check.verdict(0, 50_000, 0.5) is None  # the writing epoch is not judged
    assert check.verdict(1, 50_000, 0.5) is None  # the reading epoch starts: its mark
    assert check.verdict(1, 50_000 + MIN_ROWS, 0.5 + MIN_ROWS * 9e-6) is None  # faster: kept
    slower = PlanCheck(("g",), epoch=0, baseline_s=10e-6)
    slower.verdict(1, 0, 0.0)
    slower.verdict(1, 1, 1e-5)
    assert "reverted" in slower.verdict(1, 1 + MIN_ROWS, 1e-5 + MIN_ROWS * 12e-6)


def _costs(fingerprint: str, rows: int, features: list[str], columns: list[str], transform_s: float) -> list:
    return [{"fingerprint": fingerprint, "rows": rows, "split_s": rows * (transform_s + 1e-6),
             "columns": [[c, rows, rows * 1e-6, rows * 8] for c in columns],
             "features": [[f, rows, rows * transform_s, rows * 8] for f in features]}]


def test_a_decision_is_journaled_and_a_restarted_master_keeps_it(tables, tmp_path):
    spec = DatasetSpec.from_dict(spec_dict(tables["orc"], cache={"mode": "auto", "expected_epochs": 3}))
    store = BlockStore(str(tmp_path / "cache"), BlockSigner.plain())
    clock = Clock()
    service = MasterService(MasterConfig(), Journal(str(tmp_path / "journal")), clock, cache=store)
    service.cache = CachePlanner(store, probe=False)
    service.cache.probed = (1e9, 5e8)  # a fast cache
    service.submit(spec)
    (w,) = register(service)
    hello(service, spec)
    call(service, "start_epoch", session=session(service, "c0"), epoch=0)
    fp = service.state.job.fingerprint
    pipeline = service.bound.pipeline
    # Heavy transforms, cheap decoding: caching the transformed blocks pays over 2 more epochs.
    heartbeat(service, w, costs=_costs(fp, MIN_ROWS * 2, pipeline.feature_names, pipeline.input_columns, 50e-6))
    service.tick()
    service.sync()
    plan = dict(service.state.cache_plan)
    assert plan and {mode for mode, _ in plan.values()} == {"transformed"}
    _, split = call(service, "get_split", worker_id=w)
    assert set(split["split"]["cache"]["write_features"]) == set(pipeline.feature_names)
    status = service.status()["cache"]
    assert {g["mode"] for g in status["groups"]} == {"transformed"} and status["mode"] == "auto"

    restarted = MasterService(MasterConfig(), Journal(str(tmp_path / "journal")), Clock(), cache=store)
    assert restarted.state.cache_plan == plan
    restarted.state.snapshot()  # and a compacted journal keeps it too
    again = MasterService(MasterConfig(), None, Clock())
    again.state.apply(restarted.state.snapshot())
    assert again.state.cache_plan == plan
    store.close()


def test_keys_name_the_file_identity_and_each_features_closure():
    from dataclasses import replace

    from remoteloader.core.cache.keys import feature_key, split_key
    from remoteloader.formats import DataFile, Unit

    f = DataFile("/t/a.orc", "orc", "", 10, 1000, (Unit(0, 0, 10, 900),), "aa" * 16)
    assert split_key(f, 0, 1, 0, None) != split_key(replace(f, tail_digest="bb" * 16), 0, 1, 0, None)  # same size
    assert split_key(f, 0, 1, 0, None) == split_key(f, 0, 1, 5, None)  # the position only matters to sampling
    sampling = {"rate": 0.5, "seed": 1, "label_value": None, "weight": False}
    assert split_key(f, 0, 1, 0, sampling) != split_key(f, 0, 1, 5, sampling)

    def pipeline(salt: int):
        return compile_features([], [F("h", "a", transforms=[{"op": "sigrid_hash", "salt": salt, "max_value": 9}]),
                                     F("k", "b"), F("both", inputs=["h", "k"], transforms=[{"op": "cartesian"}])],
                                SCHEMA)

    one, two = pipeline(1), pipeline(2)
    changed = {f for f in one.feature_names if feature_key(one, f) != feature_key(two, f)}
    assert changed == {"h", "both"}  # the changed feature and the one that reads it
