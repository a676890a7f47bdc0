"""The library's one reporting channel: every eaglescope logger writes one product-form line on stderr, nothing on
stdout, and follows stderr when it is redirected after the handler was installed."""

from __future__ import annotations

import logging

from eaglescope.log import configure


def test_records_are_one_line_each_on_stderr_and_never_on_stdout(capsys):
    configure()
    configure()  # idempotent: still one handler, so one line per record
    log = logging.getLogger("eaglescope.some.module")
    log.info("prepared %d shards\n  in 3 s", 2)
    log.warning("taps %s cannot be written for sglang", [0, 3])
    log.debug("not shown without EAGLESCOPE_DEBUG")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.splitlines() == [
        "eaglescope: prepared 2 shards in 3 s",
        "eaglescope: warning: taps [0, 3] cannot be written for sglang",
    ]


def test_other_libraries_loggers_are_not_ours(capsys):
    configure()
    logging.getLogger("transformers.modeling_utils").info("loading weights")
    assert capsys.readouterr().err == ""


def test_the_demo_steps_are_its_stdout_as_written_and_not_also_a_log_line(capsys):
    from eaglescope.cli.demo import _show_steps
    from eaglescope.demo import STEPS

    configure()
    _show_steps()
    _show_steps()  # idempotent: one line per step
    STEPS.info("[2/5] data: cached")
    STEPS.info("      %-8s%6.2f", "chain=4", 2.5)  # the demo's tables are indented and aligned
    out, err = capsys.readouterr()
    assert out.splitlines() == ["[2/5] data: cached", "      chain=4   2.50"]
    assert err == ""


def test_python_dash_m_eaglescope_is_the_command():
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "eaglescope", "export", "--to", "vllm"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [
        "eaglescope: error: export: the following arguments are required: --draft, --out (see eaglescope export --help)"
    ]
