"""Config: read once, validated once; a bad key or value names key, value and what is allowed."""

from __future__ import annotations

from pathlib import Path

import pytest

from shared import config


def write(tmp_path: Path, body: str) -> str:
    p = tmp_path / "agent.yaml"
    p.write_text(body)
    return str(p)


def test_defaults_match_the_design(tmp_path: Path) -> None:
    # given the shipped default file, when it is loaded, then every value is the documented default (README.md, "Configuration")
    cfg = config.load(str(Path(__file__).parents[2] / "deploy" / "agent.yaml"))
    assert cfg == config.ProfilerConfig()
    assert (cfg.sample_hz, cfg.upload_interval_s, cfg.offcpu_min_ms, cfg.symbolizer_workers) == (19, 60, 1, 1)
    assert cfg.offcpu_sample_ms == 50
    assert cfg.strip_process_args and not cfg.plain_pid and cfg.uploads_locally


def test_an_empty_block_is_all_defaults(tmp_path: Path) -> None:
    assert config.load(write(tmp_path, "modules:\n  ebpf_profiler: {}\n")) == config.ProfilerConfig()


@pytest.mark.parametrize(
    "body, names",
    [
        ("sample_hz: abc", ["sample_hz", "'abc'", "integer from 1 to 10000"]),
        ("sample_hz: 0", ["sample_hz", "0", "integer from 1 to 10000"]),
        ("sample_hz: true", ["sample_hz", "True", "integer"]),
        ("offcpu: 1", ["offcpu", "1", "true or false"]),
        ("endpoint: ftp://x", ["endpoint", "ftp://x", "http://"]),
        ("local_dir: relative/dir", ["local_dir", "relative/dir", "absolute"]),
        ("symbolizer_workers: 65", ["symbolizer_workers", "65", "1 to 64"]),
        ("sampel_hz: 19", ["unknown key", "sampel_hz", "allowed keys", "sample_hz"]),
        ("alloc_targets: myapp", ["alloc_targets", "'myapp'", "a list of at most 64 targets"]),
        ("alloc_targets: ['']", ["alloc_targets", "['']", "executable name"]),
        ("lock_targets: ['two words']", ["lock_targets", "two words", "container id"]),
        ("lock_targets: ['cgroup:relative']", ["lock_targets", "cgroup:relative", "cgroup:/path"]),
        ("alloc_sample_bytes: -1", ["alloc_sample_bytes", "-1", "0 (every allocation)"]),
        ("offcpu_sample_ms: 5000", ["offcpu_sample_ms", "5000", "0 to 4000", "every block in full"]),
    ],
)
def test_bad_values_name_key_value_and_what_is_allowed(tmp_path: Path, body: str, names: list[str]) -> None:
    path = write(tmp_path, f"modules:\n  ebpf_profiler:\n    {body}\n")
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    for n in names:
        assert n in str(e.value)


def test_unreadable_and_non_yaml_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError, match="cannot read config file"):
        config.load(str(tmp_path / "missing.yaml"))
    with pytest.raises(config.ConfigError, match="not valid YAML"):
        config.load(write(tmp_path, "modules: [unclosed"))
    with pytest.raises(config.ConfigError, match="missing modules.ebpf_profiler"):  # noqa: RUF043
        config.load(write(tmp_path, "modules: {}\n"))


def test_dump_round_trips(tmp_path: Path) -> None:
    cfg = config.ProfilerConfig(sample_hz=99, endpoint="http://127.0.0.1:1", plain_pid=True)
    assert config.load(write(tmp_path, config.dump(cfg))) == cfg
    assert cfg.replace(sample_hz=7).sample_hz == 7
    with pytest.raises(config.ConfigError):
        cfg.replace(sample_hz=-1)


def test_targets_are_kept_as_given_without_repeats(tmp_path: Path) -> None:
    # given targets of every kind, one twice, when loaded, then they are a tuple in their order, once each
    cfg = config.load(
        write(
            tmp_path,
            "modules:\n  ebpf_profiler:\n    alloc_targets: [myapp, /usr/bin/app, "
            "0123456789ab, 'cgroup:/system.slice/app.service', myapp]\n"
            "    lock_targets: []\n    alloc_sample_bytes: 0\n",
        )
    )
    assert cfg.alloc_targets == ("myapp", "/usr/bin/app", "0123456789ab", "cgroup:/system.slice/app.service")
    assert cfg.lock_targets == () and cfg.alloc_sample_bytes == 0
    assert config.load(write(tmp_path, config.dump(cfg))) == cfg


def test_offcpu_sampling_is_off_unless_sample_ms_is_above_min_ms() -> None:
    from collector.offcpu import sample_ns

    assert sample_ns(1, 10) == 10_000_000
    assert sample_ns(1, 0) == 0 and sample_ns(10, 10) == 0 and sample_ns(20, 10) == 0
