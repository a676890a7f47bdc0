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
