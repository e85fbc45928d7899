"""`kernelcrew kb`: search, show, export and import, exit codes and readable errors."""

from __future__ import annotations

import json
import uuid

import pytest
from typer.testing import CliRunner

from kernelcrew.cli import app
from kernelcrew.config import get_settings
from kernelcrew.knowledge_base import KnowledgeBase, signature

runner = CliRunner()
PASS = {"verdict": "pass", "baseline_ms": 2.0, "candidate_ms": 0.5, "clock": "cuda-event"}


@pytest.fixture
def env(tmp_path, monkeypatch):
    """A fresh SQLite knowledge base in tmp_path, used as alice."""
    monkeypatch.setenv("KERNELCREW_DATABASE_URL", f"sqlite:///{tmp_path}/kb.db")
    monkeypatch.setenv("KERNELCREW_KB_OWNER", "alice")
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def kb(*args: str):
    return runner.invoke(app, ["kb", *map(str, args)])


def record(owner: str = "alice") -> str:
    win = {
        "gpu_model": "h100-sxm",
        "arch": "sm_90",
        "signature": signature(["softmax"], ["float32"], [[4096, 4096]]),
        "pattern_kinds": ["reduction"],
        "strategy": "torch_compile",
        "candidate_source": "class ModelNew: ...\n",
        "description": "softmax over the last dim through Inductor",
        "job_id": "job-1",
    }
    return str(KnowledgeBase.open(owner=owner).record_win(win, verdict=PASS).id)


def test_search_finds_seed_advice_for_an_architecture(env):
    result = kb("search", "online softmax", "--arch", "sm_90", "--json")
    assert result.exit_code == 0, result.output
    hits = json.loads(result.stdout)
    assert hits[0]["strategy"] == "row_reduction" and hits[0]["source"] == "seed"
    assert {h["arch"] for h in hits} == {"sm_90"}
    table = kb("search", "online softmax", "--arch", "sm_90")
    assert table.exit_code == 0 and "row_reduction" in table.stdout
    assert kb("search", "softmax", "--arch", "hopper").exit_code == 2


def test_show_a_record_and_clear_errors_for_unknown_ids(env):
    win_id = record()
    found = kb("search", "softmax inductor", "--gpu", "h100-sxm", "--json")
    assert json.loads(found.stdout)[0]["id"] == win_id
    shown = kb("show", win_id, "--json")
    assert shown.exit_code == 0
    data = json.loads(shown.stdout)
    assert data["speedup_eager"] == 4.0 and data["candidate_source"] == "class ModelNew: ...\n"
    text = kb("show", win_id)
    assert text.exit_code == 0 and "speedup_eager: 4.0" in text.stdout and "class ModelNew" in text.stdout
    missing = kb("show", str(uuid.uuid4()))
    assert missing.exit_code == 1 and "no record" in missing.output
    assert kb("show", "not-an-id").exit_code == 2


def test_export_then_import_as_another_user(env, monkeypatch):
    record()
    out = env / "wins.json"
    exported = kb("export", out)
    assert exported.exit_code == 0 and "exported 1 record(s)" in exported.output
    assert json.loads(out.read_text())["records"][0]["owner"] == "alice"
    monkeypatch.setenv("KERNELCREW_KB_OWNER", "bob")
    get_settings.cache_clear()
    imported = kb("import", out, "--visibility", "public")
    assert imported.exit_code == 0, imported.output
    assert "1 new" in imported.output
    mine = [r for r in KnowledgeBase.open().export()["records"] if r["owner"] == "bob"]
    assert [(r["visibility"], r["speedup_eager"]) for r in mine] == [("public", 4.0)]
    again = kb("import", out, "--visibility", "public")
    assert again.exit_code == 0 and "1 unchanged" in again.output, "re-importing changes nothing"


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda r: r.update(speedup=9.0), "records[0].speedup: unknown field"),
        (lambda r: r.update(before_ms="2.0"), "records[0].before_ms: Input should be a valid number"),
        (lambda r: r.update(candidate_source="#" * 1_000_001), "the limit is 1000000"),
    ],
)
def test_a_bad_import_file_exits_2_and_changes_nothing(env, mutate, message):
    record()
    good = env / "good.json"
    assert kb("export", good).exit_code == 0
    doc = json.loads(good.read_text())
    doc["records"].append({**doc["records"][0], "id": str(uuid.uuid4()), "strategy": "fused_pointwise"})
    mutate(doc["records"][0])
    bad = env / "bad.json"
    bad.write_text(json.dumps(doc))
    before = KnowledgeBase.open().export()["records"]
    result = kb("import", bad)
    assert result.exit_code == 2
    assert message in result.output and "nothing was imported" in result.output
    assert KnowledgeBase.open().export()["records"] == before


def test_missing_file_and_unreachable_database_exit_2(env, monkeypatch):
    assert kb("import", env / "nope.json").exit_code == 2
    monkeypatch.setenv("KERNELCREW_DATABASE_URL", "postgresql://kc:secret@127.0.0.1:1/none")
    get_settings.cache_clear()
    result = kb("search", "softmax")
    assert result.exit_code == 2 and "cannot migrate the database" in result.output
    assert "secret" not in result.output, "the password is masked"


def test_help_lists_kb_and_no_kb():
    assert "kb" in runner.invoke(app, ["--help"]).stdout
    assert "--no-kb" in runner.invoke(app, ["optimize", "--help"]).stdout


def test_token_list_shows_prefixes_and_revocations_never_the_token(env):
    created = runner.invoke(app, ["token", "create", "--user", "bob", "--scope", "read"])
    assert created.exit_code == 0, created.output
    token = created.stdout.strip().splitlines()[-1]
    runner.invoke(app, ["token", "create", "--user", "carol"])
    prefix = token.split("_")[1]
    assert runner.invoke(app, ["token", "revoke", prefix]).exit_code == 0
    listed = runner.invoke(app, ["token", "list"])
    assert listed.exit_code == 0 and token not in listed.stdout
    rows = [line.split("\t") for line in listed.stdout.strip().splitlines()]
    assert [r[2] for r in rows] == ["bob", "carol"]
    assert rows[0][1] == prefix and rows[0][3] == "read" and rows[0][5].startswith("revoked 20")
    assert rows[1][5] == "revoked -"
    only = runner.invoke(app, ["token", "list", "--user", "carol"])
    assert [line.split("\t")[2] for line in only.stdout.strip().splitlines()] == ["carol"]
