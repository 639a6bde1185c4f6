"""YAML config files as untrusted input: aliases that stand for billions of values are refused in linear time,
naming the file, and the values the aliases share keep their meaning under `${VAR}` and `--set`."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from raydl.config import load_config

pytestmark = pytest.mark.timeout(60)

_HEAD = "source: {kind: images, path: /x}\nloader: {batch_size: 8}\n"


def _alias_bomb(levels: int = 9) -> str:
    """A billion-laughs config: each level a list of 9 aliases of the level below (9**9 strings at the top)."""
    lines = [_HEAD + "job:", '  x0: &a0 ["${HOME:-lol}", "${HOME:-lol}"]']
    lines += [f"  x{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


def test_nested_aliases_are_refused_quickly_naming_the_file(tmp_path):
    """A config of a few hundred bytes whose aliases stand for ~800 million strings is a ValueError naming the file
    within seconds, in a process capped at 2 GiB, instead of expanding every path."""
    path = tmp_path / "bomb.yaml"
    path.write_text(_alias_bomb())
    assert len(path.read_bytes()) < 700
    child = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
        from raydl.config import load_config
        try:
            load_config({str(path)!r})
        except ValueError as exc:
            print("refused:", exc)
    """)
    try:
        r = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("load_config was still expanding the aliases after 30 s")
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"refused: {path}: with its YAML aliases written out the config holds more than 1,000,000 values" in r.stdout


def test_a_config_that_contains_itself_or_nests_too_deeply_is_refused(tmp_path):
    """An alias inside the mapping it names, and lists nested past what the parser can follow, are ValueErrors
    naming the file (not a RecursionError)."""
    cyclic = tmp_path / "cyclic.yaml"
    cyclic.write_text(_HEAD + "job: &j {x: *j}\n")
    with pytest.raises(ValueError, match=f"{cyclic}: a YAML alias makes the config contain itself"):
        load_config(cyclic)
    deep = tmp_path / "deep.yaml"
    deep.write_text(_HEAD + "job: {x: " + "[" * 3000 + "]" * 3000 + "}\n")
    with pytest.raises(ValueError, match=f"{deep}: nested too deeply for a config"):
        load_config(deep)


def test_deep_defaults_deep_set_values_and_odd_stage_indexes_are_value_errors_naming_the_file(tmp_path):
    """`${A:-${A:-...}}` 2,000 deep, a --set value of lists 2,000 deep, invalid YAML in --set, and a stage index
    that is a digit to Python but no number to int() ('²', or 5,000 digits): each a ValueError naming the file
    (not a RecursionError, or int()'s bare error)."""
    path = tmp_path / "c.yaml"
    path.write_text(_HEAD + "job: {state_dir: '" + "${RAYDL_UNSET_X:-" * 2000 + "x" + "}" * 2000 + "'}\n")
    with pytest.raises(ValueError, match=f"{path}: .* defaults nested more than 32 deep"):
        load_config(path)
    path.write_text(_HEAD + "pipeline: [decode]\n")
    for item, why in [("loader.seed=" + "[" * 2000 + "]" * 2000, "nested too deeply"),
                      ("loader.seed=[1", "not valid YAML"),
                      ("pipeline.\u00b2.x=1", "no pipeline stage"),
                      ("pipeline." + "9" * 5000 + ".x=1", "no pipeline stage")]:
        with pytest.raises(ValueError, match=why) as info:
            load_config(path, [item])
        assert str(info.value).startswith(f"{path}: --set ")
    assert load_config(tmp_path / "c.yaml", ["pipeline.0.fast=true"]).loader.batch_size == 8


def test_shared_values_expand_and_override_as_if_written_out(tmp_path, monkeypatch):
    """Aliased parts expand `${VAR}` everywhere they are used, and a --set on one path leaves the paths that share
    it as they were."""
    monkeypatch.setenv("RAYDL_TEST_SIZE", "24")
    path = tmp_path / "shared.yaml"
    path.write_text(textwrap.dedent("""
        source: {kind: images, path: /x}
        pipeline: &stages
          - decode
          - center_crop: {size: "${RAYDL_TEST_SIZE}"}
        loader: &loader {batch_size: 8, seed: 3}
        val:
          source: {kind: images, path: /y}
          pipeline: *stages
          loader: *loader
    """))
    cfg = load_config(path, ["loader.batch_size=16", "pipeline.center_crop.size=32"])
    assert cfg.loader.batch_size == 16 and cfg.val.loader.batch_size == 8 and cfg.val.loader.seed == 3
    assert cfg.pipeline.stages[1].kwargs == (("size", 32),)
    assert cfg.val.pipeline.stages[1].kwargs == (("size", "24"),)


def test_a_string_full_of_unclosed_variables_expands_in_linear_time(tmp_path):
    """`${` left open many times over is left as written, in about the time it takes to read."""
    import time

    path = tmp_path / "open.yaml"
    path.write_text(_HEAD + "job: {state_dir: '" + "${A" * 100_000 + "'}\n")
    t0 = time.perf_counter()
    assert load_config(path).job.state_dir == "${A" * 100_000
    assert time.perf_counter() - t0 < 10
