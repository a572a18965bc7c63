"""The bookkeeping audit: every rank's digest of every request it touched in a step,
compared with the driver's canonical view of that request when the plan left.

The last rank may know more tokens than the driver did (it appends its own samples at
once), and so may rank 0 when the samples feed back to it directly (`ahead`); every other
rank must know exactly as many.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection

import msgspec

from ray_runtime.messages import RowDigest, RowDigests
from ray_runtime.plan_record import Expectation


class BookkeepingMismatch(RuntimeError):
    pass


@dataclass(frozen=True)
class Mismatch:
    req_id: str
    rank: int
    field: str
    expected: object
    got: object

    def __str__(self) -> str:
        return (f"bookkeeping mismatch: request {self.req_id!r} on rank {self.rank}: "
                f"{self.field} expected {self.expected}, rank has {self.got}")


def audit(expected: dict[str, Expectation], digests: RowDigests, rank: int, ahead: bool,
          skip: Collection[str] = ()) -> list[Mismatch]:
    """Each digest against the driver's expectation of its request (requests in `skip`
    are not audited)."""
    digests.check()  # a short column would leave requests unaudited
    found: list[Mismatch] = []
    get = expected.get
    for row in zip(*msgspec.structs.astuple(digests)):
        req_id, incarnation, own_known, hash_length, computed, token_hash, conflicts, drafts = row
        exp = get(req_id)
        if exp is not None:
            known = exp.num_tokens_known
            # The common case, every field as expected, in one expression; anything else
            # takes the field-by-field path below to name the first field that differs.
            if (token_hash == exp.token_hash and incarnation == exp.incarnation
                    and hash_length == known and computed == exp.num_computed_tokens
                    and drafts == exp.num_draft_tokens and conflicts == 0
                    and (own_known >= known if ahead else own_known == known)):
                continue
        if skip and req_id in skip:
            continue
        found.extend(_findings(exp, RowDigest(*row), rank, ahead))
    return found


def _findings(exp: Expectation | None, d: RowDigest, rank: int, ahead: bool) -> list[Mismatch]:
    if exp is None:
        return [Mismatch(d.req_id, rank, "request", "not in this plan", "a row")]
    checks = [
        ("incarnation", exp.incarnation, d.incarnation),
        ("hash_length", exp.num_tokens_known, d.hash_length),
        ("num_computed_tokens", exp.num_computed_tokens, d.num_computed_tokens),
        ("num_draft_tokens", exp.num_draft_tokens, d.num_draft_tokens),
        ("token_hash", exp.token_hash, d.token_hash),
        ("num_conflicts", 0, d.num_conflicts),
    ]
    known_ok = d.num_tokens_known >= exp.num_tokens_known if ahead \
        else d.num_tokens_known == exp.num_tokens_known
    if not known_ok:
        checks.append(("num_tokens_known", exp.num_tokens_known, d.num_tokens_known))
    for field, want, got in checks:
        if want != got or field == "num_tokens_known":
            return [Mismatch(d.req_id, rank, field, want, got)]  # one per request and rank
    return []
