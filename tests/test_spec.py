"""Spec parsing and binding: every error names the key or column."""
from __future__ import annotations

import json

import pytest

from remoteloader.core.binding import bind
from remoteloader.spec import DatasetSpec, SpecError
from tests.conftest import spec_dict


def test_yaml_and_json_files_roundtrip(tmp_path, tables):
    import yaml

    d = spec_dict(tables["orc"])
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(d))
    (tmp_path / "s.json").write_text(json.dumps(d))
    a, b = DatasetSpec.from_file(tmp_path / "s.yaml"), DatasetSpec.from_file(tmp_path / "s.json")
    assert a == b and a.fingerprint() == b.fingerprint()
    assert DatasetSpec.from_dict(a.to_dict()) == a


def test_relative_table_path_is_relative_to_the_spec_file(tmp_path):
    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "s.yaml").write_text("table: {path: ../data/t}\nfeatures: {label: label}\n")
    assert DatasetSpec.from_file(tmp_path / "conf" / "s.yaml").table.path == str(tmp_path / "data" / "t")


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d.update(batchsize=3), r"^batchsize: unknown key"),
    (lambda d: d["table"].update(fromat="orc"), r"^table\.fromat: unknown key"),
    (lambda d: d["features"]["dense"][1].update(colum="x"), r"^features\.dense\[1\]\.colum: unknown key"),
    (lambda d: d.update(batch_size="big"), r"^batch_size: expected a positive integer"),
    (lambda d: d.update(batch_size=0), r"^batch_size: must be positive"),
    (lambda d: d.update(shuffle="yes"), r"^shuffle: expected true or false"),
    (lambda d: d["table"].update(format="csv"), r"^table\.format: must be one of"),
    (lambda d: d["table"].update(partitions=[]), r"^table\.partitions: the list is empty"),
    (lambda d: d.update(features={}), r"^features: the selection is empty"),
    (lambda d: d["features"]["sparse"][0].pop("column"), r"needs exactly one of 'column' or 'inputs'"),
    (lambda d: d["features"]["sparse"].append({"name": "s0", "column": "idlist_2"}), r"defined twice"),
    (lambda d: d["features"]["sparse"][0]["transforms"].append("firstx"), r"transforms\[1\]: expected a mapping"),
    (lambda d: d.pop("table"), r"^table: required key is missing"),
    (lambda d: d.update(on_error="ignore"), r"^on_error: must be one of"),
])
def test_structural_errors_name_the_key(tables, mutate, match):
    d = spec_dict(tables["orc"])
    mutate(d)
    with pytest.raises(SpecError, match=match):
        DatasetSpec.from_dict(d)


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["features"]["dense"].append({"name": "g", "column": "nope"}), "nope"),
    (lambda d: d["features"]["dense"].append({"name": "g", "column": "idlist_2"}), "idlist_2"),
    (lambda d: d["features"].update(label="idlist_0"), r"features\.label: column 'idlist_0' has type id_list"),
    (lambda d: d["features"].update(passthrough=["nope"]), r"features\.passthrough\[0\]: column 'nope' is not in"),
    (lambda d: d["table"].update(path="/nonexistent/table"), r"table: .*/nonexistent/table"),
    (lambda d: d["table"].update(partitions=["ds=1999-01-01"]), r"ds=1999-01-01"),
    (lambda d: d["features"]["sparse"][0]["transforms"].append({"op": "firstx"}), r"s0.*x"),
    (lambda d: d["features"]["sparse"][0]["transforms"].append({"op": "warp"}), r"s0.*warp"),
])
def test_binding_errors_name_the_column_or_key(tables, mutate, match):
    d = spec_dict(tables["orc"])
    mutate(d)
    with pytest.raises(SpecError, match=match):
        bind(DatasetSpec.from_dict(d))


def test_fingerprint_changes_with_any_setting(tables):
    a = DatasetSpec.from_dict(spec_dict(tables["orc"]))
    assert a.fingerprint() != a.replace(batch_size=7).fingerprint()
    assert a.fingerprint() == DatasetSpec.from_dict(spec_dict(tables["orc"])).fingerprint()


def test_validate_cli_reports_what_it_would_read(tables, tmp_path, capsys):
    from remoteloader.tools.cli import main

    path = tmp_path / "s.json"
    path.write_text(json.dumps(spec_dict(tables["orc"])))
    assert main(["validate", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == 4 and report["rows"] == 5000
    assert report["columns_read"] == ["float_0", "float_1", "idlist_0", "idlist_1", "label", "row_id"]
    assert 0 < report["bytes_to_read_estimate"] < report["bytes_in_files"]
    bad = tmp_path / "bad.json"
    d = spec_dict(tables["orc"])
    d["features"]["dense"].append({"name": "g", "column": "nope"})
    bad.write_text(json.dumps(d))
    assert main(["validate", str(bad)]) == 2
    assert "nope" in capsys.readouterr().err


def test_hostile_spec_files_fail_fast_naming_the_file(tmp_path):
    laughs = tmp_path / "laughs.yaml"
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    laughs.write_text("\n".join(lines) + "\ntable: t\n")
    with pytest.raises(SpecError, match="laughs.yaml.*aliases"):
        DatasetSpec.from_file(laughs)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"table: \xff\xfe\n")
    with pytest.raises(SpecError, match="binary.yaml.*not UTF-8"):
        DatasetSpec.from_file(binary)
    deep = tmp_path / "deep.yaml"
    deep.write_text("table: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(SpecError, match="deep.yaml"):
        DatasetSpec.from_file(deep)


@pytest.mark.parametrize("uri", ["s3://KEY:hunter2@bucket/t", "slow+s3://KEY:hunter2@bucket/t?profile=hdd",
                                 "gs://hunter2@bucket/t"])
def test_a_table_uri_with_credentials_is_refused_without_repeating_them(uri):
    with pytest.raises(SpecError, match=r"^table\.path: a table URI must not carry credentials") as e:
        DatasetSpec.from_dict({"table": uri, "features": {"label": "label"}})
    assert "hunter2" not in str(e.value)
    assert all(w in str(e.value) for w in ("environment", "profile", "role"))


SCHEMA = {"label": "float", "x": "float", "ids": "id_list"}


def _sized(borders: int, **top) -> DatasetSpec:
    onehot = {"name": "oh", "column": "x", "transforms": [{"op": "onehot", "borders": list(range(borders))}]}
    return DatasetSpec.from_dict({"table": "/t", "features": {"label": "label", "dense": ["x", onehot],
                                                              "sparse": [{"name": "s", "column": "ids"}]}, **top})


@pytest.mark.parametrize("borders,top,match", [
    # the red team's spec: 100,000 borders took a worker to 4.5 GB
    (100_000, {}, r"^features: feature 'oh' step 0 \(onehot\): parameter 'borders': 100,000 borders, at most 65,536"),
    (65_535, {}, r"^features\.dense\[1\]: feature 'oh' brings the dense width to 65,537 float32 columns"),
    (30_000, {"batch_size": 4096}, r"^batch_size: 4,096 rows of 120,016 bytes are 469 MiB \(at most 256 MiB a piece\); "
                                   r"feature 'oh' alone is 30,001 float32 columns"),
    (30_000, {}, r"^split_rows: 65,536 rows of 120,016 bytes are 7,501 MiB \(at most 1,024 MiB a split\); "
                 r"feature 'oh' alone"),
])
def test_specs_too_big_for_a_worker_are_refused_naming_the_feature(borders, top, match):
    from remoteloader.core.binding import bind_schema

    with pytest.raises(SpecError, match=match):
        bind_schema(_sized(borders, **top), SCHEMA)


def test_the_size_caps_leave_room_for_wide_rows():
    from remoteloader.core.binding import bind_schema

    assert bind_schema(_sized(30_000, batch_size=1024, split_rows=4096), SCHEMA).pipeline.dense_width == 30_002
    bucketized = {"name": "b", "column": "x", "transforms": [{"op": "bucketize", "borders": list(range(65_536)),
                                                             "as_sparse": True}]}
    spec = DatasetSpec.from_dict({"table": "/t", "features": {"label": "label", "sparse": [bucketized]}})
    assert bind_schema(spec, SCHEMA).sparse_keys == ["b"]
