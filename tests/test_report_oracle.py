"""A brute-force oracle for ``inspect_load``'s report over random loads of patchkit's own
toy models (``TinyLlamaRuntime``: tensor-parallel ranks, packed q/k/v and gate/up, fused
experts, expert parallelism, tied embeddings; ``PlainModel``), with random dense and
NaN-masked sparse patches (float32, bfloat16, float16, repeated names, values equal to
the old ones, random bit patterns, ``split_patch``), random ``max_chunk_bytes``, runtime
tensors in other memory layouts (transposed, column-sliced, every other row), loads with
and without ``transactional``, a second load passed the first report as ``reuse=``, and
loads that fail part-way (the entry after ``N`` raises, or a ``weight_loader`` raises
after its write).

Nothing of the report's own machinery is used to check it: every runtime tensor is
copied before and after the load (with its strides), ``load_weights`` is wrapped to log
the names each call was sent and what it returned, and

- ``writes`` are replayed in order from the copy before the load, each row a ``copy_``
  of the patch's staged tensor at ``checkpoint_offset`` (following ``shape`` and
  ``checkpoint_stride``) into the runtime tensor at ``target_offset`` (``t.flatten()``'s
  numbering, ``target_stride`` in memory), NaN-merged for a sparse patch: the replay must
  give the model bit for bit as the load left it (or as it was when the load raised),
  and each row's ``elements``, ``written`` and ``changed`` must be the replay's;
- ``deltas`` must hold every tensor a row wrote or whose bits changed and no other, its
  ``elements`` the union of the written elements, ``changed`` the bitwise difference of
  the copies, ``max_abs``, ``mean_abs`` and ``rel_l2`` recomputed in float64;
- ``chunks`` and ``calls`` must agree with :func:`patchkit.plan_chunks` and with the
  calls logged, ``loaded`` with what they returned (nothing after a rollback);
- a transactional load that failed must leave every tensor's bits as they were, say
  ``rolled_back``, carry its error, and keep the rows of the writes it made (replayed
  as above against the model at the moment it raised), with no ``deltas`` rows.
"""
from __future__ import annotations

import collections
import math
import random
import warnings

import pandas as pd
import torch

import patchkit
from patchkit import CheckpointWeightPatch as P
from patchkit.build import random_sparse_patch, split_patch
from patchkit.loader import canonicalize_tied
from patchkit.toymodels import (
    PlainModel,
    TinyLlamaConfig,
    TinyLlamaRuntime,
    tiny_llama_checkpoint,
    tiny_llama_shapes,
)

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
FLOATS = [torch.float32, torch.bfloat16, torch.float16]


class Injected(RuntimeError):
    pass


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(INT[t.element_size()])


def snapshot(model) -> dict[str, torch.Tensor]:
    """Each runtime tensor (first names of tied ones), copied with its own strides."""
    out = {}
    for n, t in [*model.named_parameters(), *model.named_buffers()]:
        out[n] = _copy(t.detach())
    return out


def _copy(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    raw = torch.empty(0, dtype=t.dtype).set_(st.clone(), 0, (st.nbytes() // t.element_size(),))
    return raw.as_strided(t.shape, t.stride(), t.storage_offset())


def view_at(t: torch.Tensor, shape, stride, offset) -> torch.Tensor:
    """The view of ``shape``/``stride`` (in memory) whose first element is
    ``t.flatten()[offset]``."""
    start, rest = t.storage_offset(), int(offset)
    for size, step in zip(reversed(t.shape), reversed(t.stride())):
        start += (rest % size) * step
        rest //= size
    return t.as_strided(tuple(shape), tuple(stride), start)


def row_major_index(t: torch.Tensor) -> torch.Tensor:
    """A tensor laid out as ``t`` holding each element's position in ``t.flatten()``."""
    raw = torch.full((t.untyped_storage().nbytes() // t.element_size(),), -1, dtype=torch.long)
    idx = raw.as_strided(t.shape, t.stride(), t.storage_offset())
    idx.copy_(torch.arange(t.numel()).view(t.shape))
    return idx


def staged(p: P) -> torch.Tensor:
    """The checkpoint-shaped tensor a patch stands for (NaN where a sparse one keeps)."""
    if p.indices is None:
        return p.values.to(p.dtype).reshape(p.shape)
    s = torch.full((math.prod(p.shape),), float("nan"), dtype=p.dtype)
    s[p.indices.long()] = p.values.to(p.dtype)
    return s.view(p.shape)


def float64_stats(before, after, mask) -> tuple[float, float, float]:
    b = before.detach().double().flatten()[mask]
    d = after.detach().double().flatten()[mask] - b
    d = torch.where(torch.isfinite(d), d, 0.0).abs()
    b = torch.where(torch.isfinite(b), b, 0.0)
    n = int(mask.sum())
    num, den = math.sqrt(float((d * d).sum())), math.sqrt(float((b * b).sum()))
    return (float(d.max()) if n else 0.0, float(d.sum()) / n if n else math.nan,
            num / den if den else (math.inf if num else 0.0))


def close(x: float, y: float) -> bool:
    if math.isnan(x) or math.isnan(y) or math.isinf(x) or math.isinf(y):
        return x == y or (math.isnan(x) and math.isnan(y))
    # (the compiled path sums bfloat16 partly in float32: up to 1e-6 relative, as the
    # LoadReport docstring says)
    return abs(x - y) <= 2e-6 * max(abs(x), abs(y)) + 1e-12


def random_bits(g, n, dtype, nan_ok) -> torch.Tensor:
    info = torch.iinfo(INT[dtype.itemsize])
    x = torch.randint(info.min, info.max, (n,), generator=g).to(INT[dtype.itemsize]).view(dtype)
    return x if nan_ok else torch.where(torch.isnan(x), torch.zeros_like(x), x)


# ------------------------------------------------------------------------------- a case


def make_model(rng, g, seed):
    if seed % 5 != 4:
        ne = rng.choice([0, 2, 4])
        heads = rng.choice([2, 4])
        cfg = TinyLlamaConfig(vocab_size=rng.choice([64, 128]), hidden_size=rng.choice([8, 16]),
                              intermediate_size=rng.choice([8, 16]), num_layers=rng.choice([1, 2]),
                              num_heads=heads, num_kv_heads=rng.choice([1, 2]),
                              tie_word_embeddings=rng.random() < 0.3, num_experts=ne)
        ep = ne > 0 and rng.random() < 0.4
        tps = [t for t in (1, 2, 4) if heads % t == 0 and (cfg.num_kv_heads % t == 0
               or t % cfg.num_kv_heads == 0) and (ne % t if ep else cfg.intermediate_size % t) == 0]
        tp = rng.choice(tps)
        m = TinyLlamaRuntime(cfg, tp_rank=rng.randrange(tp), tp_size=tp,
                             dtype=rng.choice([*FLOATS, torch.float64]), expert_parallel=ep)
        shapes = dict(tiny_llama_shapes(cfg))
        base = tiny_llama_checkpoint(cfg, seed=seed, dtype=torch.float32)
        if cfg.tie_word_embeddings:  # (an alias patch: renamed, or dropped beside its first)
            shapes["lm_head.weight"] = shapes["model.embed_tokens.weight"]
            base["lm_head.weight"] = base["model.embed_tokens.weight"]
    else:
        shapes = {f"l{i}.w": tuple(rng.randint(1, 6) for _ in range(rng.choice([1, 2, 3])))
                  for i in range(rng.randint(1, 4))}
        m = PlainModel(shapes, dtype=rng.choice(FLOATS))
        base = {n: torch.randn(s, generator=g) for n, s in shapes.items()}
    if seed % 7 == 3:  # runtime tensors in other layouts: transposed, column-sliced, strided
        for p in m.parameters():
            d = p.data
            how = rng.choice(["t", "cols", "rows"]) if d.dim() >= 2 else "rows"
            if how == "t":
                order = list(range(d.dim()))[::-1]
                new = torch.empty_like(d.permute(order)).permute(order)
            elif how == "cols":
                new = torch.empty(*d.shape[:-1], d.shape[-1] + 2, dtype=d.dtype)[..., 1:-1]
            else:
                new = torch.empty(2 * d.shape[0], *d.shape[1:], dtype=d.dtype)[::2]
            p.data = new.copy_(d)
    if rng.random() < 0.3:
        base = {n: t.flatten().index_put((torch.randperm(t.numel(), generator=g)[:3],),
                                         random_bits(g, min(3, t.numel()), t.dtype, True)
                                         ).view(t.shape) for n, t in base.items()}
    patchkit.load_checkpoint_weight_patches(m, [
        P(n, tuple(t.shape), t.dtype, t.flatten()) for n, t in base.items()])
    return m, shapes, base


def make_patches(rng, g, shapes, base, sparse):
    out = []
    for _ in range(rng.randint(1, 7)):
        n = rng.choice(list(shapes))
        shape, dt = shapes[n], rng.choice(FLOATS)
        numel = math.prod(shape)
        b = base[n].flatten()
        if not sparse:
            v = b.clone()
            k = rng.randint(0, numel if rng.random() < 0.5 else max(1, numel // 20))
            v[torch.randperm(numel, generator=g)[:k]] = torch.randn(k, generator=g)
            if rng.random() < 0.2:
                k = rng.randint(1, numel)
                v = v.to(dt)
                v[torch.randperm(numel, generator=g)[:k]] = random_bits(g, k, dt, True)
            out.append(P(n, shape, dt, v.to(dt)))
            continue
        b = torch.where(torch.isnan(b), 0.0, b)
        how = rng.random()
        if how < 0.3:
            out.append(random_sparse_patch(
                n, shape, dt, rng.choice([0.05, 0.3, 1.0]), generator=g,
                pattern=rng.choice(["uniform", "rows", "blocks"]), block=rng.choice([1, 2]),
                index_dtype=rng.choice([torch.int32, torch.int64])))
        elif how < 0.45:
            v = b.clone()
            k = rng.randint(0, numel)
            v[torch.randperm(numel, generator=g)[:k]] = torch.randn(k, generator=g)
            out.extend(split_patch(P(n, shape, dt, v.to(dt)), rng.randint(1, 3)))
        else:
            k = rng.randint(0, numel)
            idx = torch.randperm(numel, generator=g)[:k]
            vals = b[idx].clone()  # (some old values: written, unchanged)
            new = torch.rand(k, generator=g) < rng.random()
            vals[new] = torch.randn(int(new.sum()), generator=g)
            if rng.random() < 0.2:
                vals = vals.to(dt)
                vals[new] = random_bits(g, int(new.sum()), dt, False)
            out.append(P(n, shape, dt, vals.to(dt), idx.to(rng.choice([torch.int32,
                                                                       torch.int64]))))
    return out


def load(rng, g, seed, k, model, shapes, base, reuse):
    """One logged load; what the checks need."""
    sparse = (seed + k) % 2 == 1
    patches = make_patches(rng, g, shapes, base, sparse)
    mcb = rng.choice([1, 64, 256, 1024, 1 << 20])
    transactional = (seed // 6 + k) % 2 == 0
    fail = ["none", "entry", "inside"][(seed // 2 + k) % 3]
    fail_at = rng.randrange(len(patches) + 1) if fail == "entry" else None
    fail_in = None
    if fail == "inside":  # (a TinyLlamaRuntime parameter's loader that raises after writing)
        loaders = [n for n, p in model.named_parameters() if hasattr(p, "weight_loader")]
        fail_in = rng.choice(loaders) if loaders else None
    before = snapshot(model)
    sent, returned, at_fail, entries = [], [], {}, [0]
    own = model.load_weights

    def load_weights(weights):
        weights = list(weights)
        sent.append(tuple(n for n, _ in weights))

        def entry_by_entry():
            for item in weights:
                if entries[0] == fail_at:
                    raise Injected(f"the entry after {fail_at}")
                entries[0] += 1
                yield item
        try:
            r = own(entry_by_entry())
        except BaseException:
            at_fail.update(snapshot(model))  # (before any rollback)
            raise
        returned.append(r)
        return r

    model.load_weights = load_weights
    if fail_in is not None:
        param = dict(model.named_parameters())[fail_in]
        weight_loader = param.weight_loader

        def failing(*args, **kwargs):
            weight_loader(*args, **kwargs)
            raise Injected(f"after a write into {fail_in}")
        param.weight_loader = failing
    err = None
    try:
        report = patchkit.inspect_load(model, patches, max_chunk_bytes=mcb,
                                       transactional=transactional, reuse=reuse)
    except Injected as e:
        err, report = e, e.report
    finally:
        del model.load_weights
        if fail_in is not None:
            param.weight_loader = weight_loader
    kept, positions = canonicalize_tied(model, patches, warn=False)
    return dict(patches=patches, report=report, err=err, before=before,
                after=snapshot(model), at_fail=at_fail, sent=sent, returned=returned,
                plan=patchkit.plan_chunks(kept, mcb, positions=positions),
                sent_as={i: q.name for q, i in zip(kept, positions)},
                transactional=transactional)


def logged_load(m, patches):
    """``inspect_load`` of ``patches`` into ``m``, with what
    :func:`check` needs to replay its report."""
    before = snapshot(m)
    sent, returned = [], []
    own = m.load_weights

    def load_weights(weights):
        weights = list(weights)
        sent.append(tuple(n for n, _ in weights))
        r = own(weights)
        returned.append(r)
        return r

    m.load_weights = load_weights
    try:
        report = patchkit.inspect_load(m, patches)
    finally:
        del m.load_weights
    return dict(patches=patches, report=report, err=None, before=before, after=snapshot(m),
                at_fail={}, sent=sent, returned=returned,
                plan=patchkit.plan_chunks(patches, patchkit.DEFAULT_MAX_CHUNK_BYTES),
                sent_as={i: p.name for i, p in enumerate(patches)}, transactional=False)


def check(L, seen: collections.Counter) -> list[str]:
    patches, report, err = L["patches"], L["report"], L["err"]
    before, after, sent, returned, plan = (L[k] for k in ("before", "after", "sent",
                                                           "returned", "plan"))
    failed, rolled = err is not None, err is not None and L["transactional"]
    problems: list[str] = []
    bad = problems.append

    # a failed transactional load: the model as before, and a report that says so
    if rolled:
        for n in before:
            if not torch.equal(bits(before[n]), bits(after[n])):
                bad(f"the rollback left {n} changed")
        if not report.rolled_back:
            bad("rolled_back is False after a transactional load failed")
    if report.error is not err:
        bad(f"error {report.error!r}, the load raised {err!r}")

    # chunks and calls: the plan, and the calls logged
    if [c.names for c in plan[:len(sent)]] != sent or (
            not failed and len(plan) != len(sent)):
        bad(f"calls sent {sent}, plan_chunks {[c.names for c in plan]}")
    calls, wr, ch = report.calls, report.writes, report.chunks
    if len(calls) != len(sent):
        bad(f"{len(calls)} calls rows, {len(sent)} calls made")
    for i in range(min(len(calls), len(sent))):
        row = calls.iloc[i]
        if tuple(row["names"]) != sent[i]:
            bad(f"calls[{i}].names {row['names']}, sent {sent[i]}")
        raised = i >= len(returned)
        if bool(row["error"]) != raised:
            bad(f"calls[{i}].error {row['error']}")
        if not raised and (None if row["returned"] is None else set(row["returned"])) \
                != returned[i]:
            bad(f"calls[{i}].returned {row['returned']}, returned {returned[i]}")
        if int(row["writes"]) != int((wr["chunk"] == i).sum()):
            bad(f"calls[{i}].writes {row['writes']}, {int((wr['chunk'] == i).sum())} rows")
    chunk_of = {p: c for c in plan for p in c.positions}
    for i in range(len(patches)):
        row = ch.iloc[i]
        c = chunk_of.get(i)
        if c is None:
            if not pd.isna(row["chunk"]):
                bad(f"chunks[{i}].chunk {row['chunk']} for a dropped tied alias")
            seen["dropped tied aliases"] += 1
            continue
        if row["chunk"] != c.index or row["closed_by"] != c.closed_by:
            bad(f"chunks[{i}] {row['chunk']}/{row['closed_by']}, planned {c.index}/{c.closed_by}")
        if row["name"] != L["sent_as"][i]:
            bad(f"chunks[{i}].name {row['name']}, sent as {L['sent_as'][i]}")
        seen["closed by " + c.closed_by] += 1
    want_loaded = set() if rolled else set().union(*(r or () for r in returned))
    if report.loaded != want_loaded:
        bad(f"loaded {report.loaded}, calls returned {returned}, rolled back: {rolled}")

    # writes: replayed from the copy before the load
    sim = {n: _copy(t) for n, t in before.items()}
    index = {n: row_major_index(t) for n, t in sim.items()}
    masks = {n: torch.zeros(t.numel(), dtype=torch.bool) for n, t in sim.items()}
    for k in range(len(wr)):
        row = wr.iloc[k]
        target, shape, pos = row["target"], tuple(row["shape"]), row["position"]
        if target not in sim or row["op"] != "aten::copy_" or row["checkpoint_offset"] is None:
            bad(f"writes[{k}]: {target} {row['op']} {row['checkpoint_offset']}: the toy "
                "loaders make plain copies into their tensors")
            continue
        p = patches[int(pos)]
        if row["name"] != L["sent_as"][int(pos)]:
            bad(f"writes[{k}].name {row['name']}, patch {int(pos)} sent as {p.name}")
        if int(row["elements"]) != math.prod(shape):
            bad(f"writes[{k}].elements {row['elements']} for shape {shape}")
        try:
            src = staged(p).flatten().as_strided(shape, tuple(row["checkpoint_stride"]),
                                                 int(row["checkpoint_offset"]))
            dst = view_at(sim[target], shape, row["target_stride"], row["target_offset"])
        except RuntimeError as e:
            bad(f"writes[{k}] names a region outside its tensor: {e}")
            continue
        keep = torch.isnan(src) if p.indices is not None else torch.zeros(shape, dtype=bool)
        old = dst.clone()
        dst.copy_(src)  # (torch's cast as the loader's copy_ makes it, in these strides)
        dst.copy_(torch.where(keep, bits(old), bits(dst)).view(dst.dtype))
        written, changed = int((~keep).sum()), int((bits(old) != bits(dst)).sum())
        if (int(row["written"]), int(row["changed"])) != (written, changed):
            bad(f"writes[{k}] written/changed {row['written']}/{row['changed']}, replayed "
                f"{written}/{changed}")
        masks[target][view_at(index[target], shape, row["target_stride"],
                              row["target_offset"])[~keep]] = True
        seen["writes"] += 1
        seen["sparse writes" if p.indices is not None else "dense writes"] += 1
        seen["partly changed writes"] += 0 < changed < written
        seen["writes into non-contiguous tensors"] += not sim[target].is_contiguous()
    end = L["at_fail"] if failed else after
    for n in before:
        if not torch.equal(bits(sim[n]), bits(end[n])):
            bad(f"the writes replayed differ from the model in {n}: "
                f"{int((bits(sim[n]) != bits(end[n])).sum())} elements")

    # deltas
    de = report.deltas
    if rolled:
        if len(de):
            bad(f"deltas rows after a rollback: {list(de.index)}")
        seen["transactional failures with writes"] += len(wr) > 0
        return problems
    seen["failures with writes, left standing"] += failed and len(wr) > 0
    for n in before:
        changed = int((bits(before[n]) != bits(after[n])).sum())
        m = masks[n]
        if n not in de.index:
            if m.any() or changed:
                bad(f"{n} is not in deltas: {int(m.sum())} written, {changed} changed")
            continue
        r = de.loc[n]
        if (int(r["elements"]), int(r["changed"])) != (int(m.sum()), changed):
            bad(f"deltas[{n}] elements/changed {r['elements']}/{r['changed']}, replayed "
                f"{int(m.sum())}/{changed}")
        for col, want in zip(("max_abs", "mean_abs", "rel_l2"),
                             float64_stats(before[n], after[n], m)):
            if not close(float(r[col]), want):
                bad(f"deltas[{n}].{col} {r[col]!r}, recomputed {want!r}")
        seen["deltas rows"] += 1
        seen["deltas rows partly changed"] += 0 < changed < int(m.sum())
    for n in de.index.difference(list(before)):
        bad(f"deltas names {n}, which is no runtime tensor")
    return problems


def run_case(seed: int, seen: collections.Counter) -> list[str]:
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    model, shapes, base = make_model(rng, g, seed)
    loads, reuse = [], None
    for k in range(1 + (seed % 4 == 1)):
        loads.append(load(rng, g, seed, k, model, shapes, base, reuse))
        reuse = loads[-1]["report"]
    seen["reuse"] += len(loads) > 1
    # (every table read only now: the first report's after the second load reused it)
    return [f"load {k}: {p}" for k, L in enumerate(loads) for p in check(L, seen)]


def test_reports_of_toy_model_loads_agree_with_a_brute_force_oracle():
    # On the CPU whatever --device says: the copies and the replay are the CPU's.
    found, seen = {}, collections.Counter()
    with torch.device("cpu"), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (random_sparse_patch's "rounds to no elements")
        for seed in range(30):
            problems = run_case(seed, seen)
            if problems:
                found[seed] = problems[:4]
    assert not found
    # the slice reaches what it checks
    for what in ("dense writes", "sparse writes", "partly changed writes",
                 "writes into non-contiguous tensors", "deltas rows partly changed",
                 "closed by budget", "closed by repeated name", "closed by end",
                 "transactional failures with writes", "failures with writes, left standing",
                 "reuse"):
        assert seen[what] > 0, (what, seen)
