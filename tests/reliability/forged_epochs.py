"""Checksum-valid hostile epochs for the reliability tests: a Session's two real epochs, then a
new epoch written through the store itself with an edited copy of a real manifest."""
from __future__ import annotations

import json
import logging
from typing import Any, Callable

import pytest

from capsule import CapsuleCorrupt, Session
from capsule.store import Store


def two_epochs(path, text: str, runtime: dict, **kw: Any) -> tuple[list[int], list[int]]:
    """Epochs 1 and 2 of a session that appended `text`; the tokens of each."""
    with Session.open(path, device="cpu", runtime=runtime, **kw) as s:
        s.append(text)
        s.generate(3)
        s.checkpoint()
        first = s.tokens()
        s.generate(5)                  # epoch 2 holds 8 generated ids
        s.checkpoint()
        return first, s.tokens()


def forge(path, edit: Callable[[Any], Any], pages=(), *, of: int | None = 2, in_place: bool = False) -> int:
    """A new checksum-valid epoch whose manifest is epoch `of`'s (None: the newest) edited:
    edit(manifest as parsed JSON) returns the new one (parsed JSON, or raw bytes); with
    `in_place`, edit changes it and what it returns is ignored. Returns the new epoch's id."""
    with Store.open(path, create=False) as store:
        manifest, _ = store.load_epoch(store.latest_epoch() if of is None else of)
        m = json.loads(manifest)
        data = edit(m)
        data = m if in_place else data
        raw = data if isinstance(data, bytes) else json.dumps(data).encode()
        return store.write_epoch(list(pages), raw).id


def assert_skipped_by_name(path, runtime: dict, tokens: list[int], bad: int, field: str,
                           caplog: pytest.LogCaptureFixture) -> CapsuleCorrupt:
    """Open restores epoch 2 (`tokens`), says why epoch `bad` was skipped (naming `field`) in its
    report and a warning; a rollback to it is refused the same way and changes nothing. Returns
    the rollback's error."""
    with caplog.at_level(logging.WARNING, logger="capsule"), \
            Session.open(path, device="cpu", runtime=runtime) as s:
        assert s.restored_epoch == 2 and s.tokens() == tokens
        [report] = s.restore_report
        assert report.startswith(f"epoch {bad}:") and field in report, report
        warned = [r.getMessage() for r in caplog.records if r.name == "capsule" and r.levelno == logging.WARNING]
        assert any("restored epoch 2" in w and f"epoch {bad}:" in w and field in w for w in warned), warned
        with pytest.raises(CapsuleCorrupt, match=f"epoch {bad}") as err:
            s.rollback(bad)
        assert field in str(err.value)
        assert s.tokens() == tokens
    return err.value
