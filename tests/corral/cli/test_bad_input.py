"""Bad input through the CLI: a one-line reason on stderr, exit 1, and nothing changed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import func, select

from corral.cli import main
from tests.fixtures import Env, StartAgents
from workers.store.models import Function, Node, Operation, Replica


def _state(env: Env) -> tuple[int, int, int, int, list[tuple[object, ...]]]:
    with env.db.read() as s:
        counts = tuple(
            s.scalar(select(func.count()).select_from(t)) or 0
            for t in (Function, Node, Replica, Operation)
        )
        fns = [
            (f.name, f.min_replicas, f.max_replicas, f.image, f.kernel, f.kernel_args, f.labels)
            for f in s.scalars(select(Function))
        ]
    return (*counts, fns)  # type: ignore[return-value]


@pytest.fixture
def ready(corral_env: Env, start_agents: StartAgents) -> Env:
    start_agents(1)
    assert (
        main(
            [
                "functions",
                "deploy",
                "hello",
                "--image",
                "examples.hello",
                "--kernel",
                "/k",
                "--min",
                "1",
                "--max",
                "5",
            ]
        )
        == 0
    )
    return corral_env


BAD = [
    (["spawn", "nope"], "unknown function 'nope'"),
    (["scale", "nope", "1"], "unknown function 'nope'"),
    (["functions", "show", "nope"], "unknown function 'nope'"),
    (["nodes", "remove", "nope"], "unknown node 'nope'"),
    (["delete", "0" * 32], "unknown replica"),
    (["delete", "not-an-id"], "malformed replica id"),
    (["replicas", "show", "f" * 32], "unknown replica"),
    (["ops", "f" * 32], "unknown operation"),
    (["spawn", "hello", "-n", "0"], "count must be between 1 and 10000, got 0"),
    (["spawn", "hello", "-n", "-3"], "count must be between 1 and 10000, got -3"),
    (["spawn", "hello", "-n", "10001"], "count must be between 1 and 10000, got 10001"),
    (["spawn", "hello", "-n", "6"], "above its max of 5"),
    (["scale", "hello", "6"], "target 6 is outside hello's range [1, 5]"),
    (["scale", "hello", "0"], "target 0 is outside hello's range [1, 5]"),
    (["scale", "hello", "-1"], "target must not be negative"),
    (["functions", "deploy", "hello", "--min", "4", "--max", "2"], "max (2) is below min (4)"),
    (["functions", "deploy", "hello", "--max", "20000"], "less than or equal to 10000"),
    (["functions", "deploy", "hello", "--label", "foo"], "malformed label 'foo'"),
    (["functions", "deploy", "hello", "--env", "=x"], "malformed env '=x'"),
    (["functions", "deploy", "hello", "--env", "1A=x"], "malformed env '1A=x'"),
    (
        ["functions", "deploy", "hello", "--label", "com.openfaas.scale.max=lots"],
        "malformed label com.openfaas.scale.max='lots'",
    ),
    (["functions", "deploy", "x" * 64, "--image", "i", "--kernel", "/k"], "invalid function name"),
    (
        ["functions", "deploy", "bad\x07name", "--image", "i", "--kernel", "/k"],
        "invalid function name",
    ),
    (["functions", "deploy", "Hello", "--image", "i", "--kernel", "/k"], "invalid function name"),
    (["functions", "deploy", "new", "--image", "i"], "needs --kernel"),
    (["functions", "deploy", "new", "--kernel", "/k"], "--image is required"),
    (
        ["functions", "deploy", "new", "--image", "i", "--kernel", "/k", "--placement", "best"],
        "unknown placement policy 'best'",
    ),
    (["functions", "deploy", "web", "--image", "i", "--backend", "lambdo"], "needs --rootfs"),
    # Tenant text (issue 36): printable, bounded, of its grammar; a newline in --image forged
    # a row of `functions list`, an escape sequence repainted the operator's terminal.
    (["functions", "deploy", "hello", "--image", "i\nnew  forged"], "image: 'i\\nnew  forged' has"),
    (["functions", "deploy", "hello", "--kernel", "/k\x1b[2J"], "kernel: '/k\\x1b[2J' has"),
    (["functions", "deploy", "hello", "--kernel-args", "a \u202eb"], "kernel_args: 'a \\u202eb'"),
    (["functions", "deploy", "hello", "--initrd=-rf"], "initrd: '-rf' is not a path"),
    (["functions", "deploy", "hello", "--image", "i" * 256], "is over 255 characters"),
    (["functions", "deploy", "hello", "--image", "python -m evil"], "is not an image name"),
    (["functions", "deploy", "hello", "--rootfs", "http://a b"], "rootfs: 'http://a b' is not"),
    (["functions", "deploy", "hello", "--label", "INET_DEV=eth0;x"], "inet_dev: 'eth0;x' is not"),
    (["functions", "deploy", "hello", "--label", "NAMESERVER=1.1.1.1;x"], "name_server: '1.1"),
    (["functions", "deploy", "hello", "--label", "IMAGE_STORAGE=/s p"], "image_storage: '/s p'"),
    (["functions", "deploy", "hello", "--label", "A=b\x9b2J"], "malformed label 'A'"),
    (["nodes", "add", "not a host"], "invalid agent address"),
    (["nodes", "add", "127.0.0.1:99999"], "invalid agent address"),
    (["nodes", "add", "ftp://h:1", "--kind", "lambdo"], "invalid Lambdo host address"),
    (["nodes", "remove", "node1"], "still runs"),
]


@pytest.mark.parametrize(("argv", "reason"), BAD, ids=[" ".join(a)[:40] for a, _ in BAD])
def test_bad_input_is_refused_and_changes_nothing(
    ready: Env, capsys: pytest.CaptureFixture[str], argv: list[str], reason: str
) -> None:
    if argv[:2] == ["nodes", "remove"]:
        assert main(["spawn", "hello", "--wait"]) == 0  # node1 now runs a replica
    capsys.readouterr()
    before = _state(ready)
    assert main(argv) == 1
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("corral: error: ")
    assert reason in lines[0], lines[0]
    assert _state(ready) == before


def test_usage_errors_exit_2(ready: Env, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["spawn", "hello", "-n", "many"])
    assert exit_.value.code == 2
    assert "expected an integer, got 'many'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("toml", "reason"),
    [
        ('name = "t"\nimage = "i"\nkernel = "/k"\ncolour = "red"\n', "colour: unknown key"),
        ('name = "t"\nimage = "i"\nkernel = "/k"\nmax = "ten"\n', "max: Input should be"),
        ('name = "t"\nimage = "i"\nkernel = "/k"\nenv = ["A=1"]\n', "env: Input should be"),
        ('name = "t"\nimage = \n', "invalid TOML"),
    ],
)
def test_bad_toml_files(
    ready: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str], toml: str, reason: str
) -> None:
    path = tmp_path / "fn.toml"
    path.write_text(toml)
    capsys.readouterr()
    before = _state(ready)
    assert main(["functions", "deploy", "--file", str(path)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and reason in err, err
    assert _state(ready) == before


def test_good_toml_file_and_labels(
    ready: Env, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fn.toml"
    path.write_text(
        'name = "t"\nimage = "img:latest"\nmax = 3\n'
        '[labels]\nKERNEL_IMAGE_PATH = "/boot/k"\n"com.openfaas.scale.max" = "9"\n'
        '"com.openfaas.memory" = "256Mi"\nVM_TYPE = "linux"\n'
        '[env]\nGREETING = "hi"\n'
    )
    capsys.readouterr()
    assert main(["functions", "deploy", "--file", str(path), "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert view["image"] == "img"  # ':latest' stripped
    assert view["kernel"] == "/boot/k"  # from the seed's label
    assert view["max"] == 3  # the explicit key wins over the label
    assert (view["mem"], view["vm_type"], view["env"]) == (256, "linux", {"GREETING": "***"})
    assert main(["functions", "show", "t", "--show-secrets", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["env"] == {"GREETING": "hi"}
