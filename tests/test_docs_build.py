"""The documentation site builds strictly: docs/*.md as the guide, the API reference from the
docstrings (mkdocs.yml, docs/reference.py). A broken link, anchor or cross-reference fails the
build, and so does a public function or class without a docstring."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml

pytest.importorskip("mkdocstrings", reason="needs the docs extra: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",
            "--config-file",
            str(config),
            "--site-dir",
            str(site),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.slow
def test_the_site_builds_strictly_with_every_public_name(tmp_path: Path) -> None:
    done = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert done.returncode == 0, done.stderr[-5000:]
    reference = (tmp_path / "site" / "reference" / "fnaccel" / "index.html").read_text()
    assert 'id="fnaccel.runtime.init"' in reference and 'id="fnaccel.train.step"' in reference
    assert 'class="language-pycon"' in reference  # the >>> examples shown as code


@pytest.mark.slow
def test_a_planted_broken_link_and_reference_fail_the_build(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)
    (docs / "state.md").write_text(
        (docs / "state.md").read_text() + "\nSee [the missing page](missing.md) and [fnaccel.nowhere][].\n"
    )
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    # the guide alone: generating the reference again would double the test's time (the build above
    # covers it); the links are checked by the same strict settings and cross-references by autorefs
    config.update(docs_dir=str(docs), hooks=[], nav=config["nav"][:1])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert "Doc file 'state.md' contains a link 'missing.md'" in done.stderr, done.stderr[-3000:]
    assert "Could not find cross-reference target 'fnaccel.nowhere'" in done.stderr, done.stderr[-3000:]


def test_a_public_function_without_a_docstring_is_reported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "docs" / "reference.py")
    assert spec is not None and spec.loader is not None
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    module = types.ModuleType("planted")
    exec("def documented():\n    'Says what it does.'\n\ndef bare():\n    pass\n", module.__dict__)
    module.__dict__["__all__"] = ["documented", "bare"]
    monkeypatch.setitem(sys.modules, "planted", module)
    with caplog.at_level(logging.WARNING):
        text = reference.page("planted", {})
    assert "::: planted.documented" in text and "::: planted.bare" in text
    assert [r.getMessage() for r in caplog.records] == [
        "planted.bare has no docstring: write one (the reference is generated from it)"
    ]
