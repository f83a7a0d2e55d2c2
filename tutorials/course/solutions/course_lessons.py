"""The course's text: seven lessons of markdown, given code and exercises (with their solutions).

``course_build.py`` writes each lesson as an exercise notebook and a solution notebook.
"""

from __future__ import annotations

from course_cells import SETUP, code, exercise, head, hints, md

SCIENCE = "../../docs/science.md"

LESSON_1 = [
    head(
        1,
        "The logit lens by hand",
        "read every layer's residual state as if it were the last: the final norm, the "
        "unembedding, the KL to the model's output, per layer and position; then the mean per "
        "layer over real tokens — the numbers `lensdiv analyze --plugins lens` reports.",
        f"[tutorial 1](../01_quickstart.ipynb) (the quickstart), [docs/science.md: conventions]({SCIENCE}#conventions) "
        f"(residual states, readout, positions) and [the logit lens]({SCIENCE}#lens).",
        "40 minutes",
        "★☆☆ (tensor shapes, softmax)",
    ),
    code(SETUP),
    md("""
## The residual states

`toy.residual_states(model, tokens)` runs the model and returns its logits and the stack of
residual states `states[l] = h_l`, `[L + 1, batch, pos, d_model]`: `h_0` the embedding, `h_l` the
input of block `l`, `h_L` the last block's output **before** the final norm. The prompts are
packed as lensdiv packs text: BOS first, rows right-padded, `mask` True at real tokens.
"""),
    code("""
ids, mask = toy.tokens(model, toy.PROMPTS)
logits, states = toy.residual_states(model, ids)
params = toy.readout_params(model)  # ln_w, ln_b, eps (the final LayerNorm), W_U, b_U
print("states", tuple(states.shape), "| logits", tuple(logits.shape), "| real tokens per row", mask.sum(1).tolist())
"""),
    md(f"""
## Exercise 1.1 — the final norm

The model reads its output through a LayerNorm: `N(h) = w ⊙ (h − mean(h)) / sqrt(var(h) + eps) + b`,
with the mean and variance over the last axis (`d_model`). Write it for any leading shape.

{hints("The variance of a LayerNorm divides by `d`, not `d − 1`.", "`x = h - h.mean(-1, keepdim=True)`, then `x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()`.")}
"""),
    exercise(
        '''
def final_norm(h, w, b, eps):
    """LayerNorm of the last axis of h, then scale w and shift b."""
''',
        """
    x = h - h.mean(-1, keepdim=True)
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt() * w + b
""",
    ),
    code(
        "from lensdiv.course import logit_lens as check\n\nfinal_norm = check.check_final_norm(final_norm)"
    ),
    md(f"""
## Exercise 1.2 — the lens' logits

`p_l = softmax(W_U N(h_l) + b_U)`: the logits of a state read as if it were the last. `W_U` is
`[d_model, d_vocab]`.

{hints("Use your `final_norm`.", "`final_norm(h, ln_w, ln_b, eps) @ W_U + b_U`.")}
"""),
    exercise(
        '''
def lens_logits(h, ln_w, ln_b, eps, W_U, b_U):
    """Logits [..., d_vocab] of residual states h [..., d_model] through the final norm and unembedding."""
''',
        """
    return final_norm(h, ln_w, ln_b, eps) @ W_U + b_U
""",
    ),
    code("lens_logits = check.check_lens_logits(lens_logits)"),
    md(f"""
## Exercise 1.3 — KL to the output

`KL(p_l ‖ p_out) = Σ_v p_l(v) (log p_l(v) − log p_out(v))`, one number per row (the last axis is
the vocabulary), in nats. At `h_L` it is 0.

{hints("`torch.log_softmax` gives log-probabilities from logits, stably.", "`lp, lq = logits.log_softmax(-1), out_logits.log_softmax(-1)`; `(lp.exp() * (lp - lq)).sum(-1)`.", "`F.kl_div(input, target)` computes KL(target ‖ input): easy to get backwards.")}
"""),
    exercise(
        '''
def kl_to_output(logits, out_logits):
    """KL(p_l || p_out) per row, from the lens' logits and the model's output logits."""
''',
        """
    lp, lq = logits.log_softmax(-1), out_logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1)
""",
    ),
    code("kl_to_output = check.check_kl_to_output(kl_to_output)"),
    md(f"""
## Exercise 1.4 — the mean per layer, over real tokens

`values` is `[layer, batch, pos]` (a KL per layer and position). Average each layer over the
**real tokens** (`mask`), leaving BOS (position 0) out when `exclude_bos` is True — one mean over
all kept tokens of the batch, not a mean of the rows' means.

{hints("`keep = mask.clone()`; `keep[:, 0] = False` when excluding BOS.", "`values[:, keep]` is `[layer, kept tokens]`: take its mean over the last axis.")}
"""),
    exercise(
        '''
def mean_per_layer(values, mask, exclude_bos):
    """Mean of values [layer, batch, pos] over the kept positions: one number per layer."""
''',
        """
    keep = mask.clone()
    if exclude_bos:
        keep[:, 0] = False
    return values[:, keep].mean(-1)
""",
    ),
    code("mean_per_layer = check.check_mean_per_layer(mean_per_layer)"),
    md("""
## Putting it together: the logit lens of the toy

Your functions, per layer, against `lensdiv.analyze(..., plugins="lens")` on each prompt
(`lens` keeps BOS by default): the two lines should agree to float precision.
"""),
    code("""
import lensdiv

out = logits.unsqueeze(0).expand(L + 1, *logits.shape)
kl = kl_to_output(lens_logits(states, **params), out)  # [L + 1, batch, pos]
mine = mean_per_layer(kl, mask, exclude_bos=False)  # over the real tokens of all 3 prompts
for row, text in enumerate(toy.PROMPTS):
    n = int(mask[row].sum())
    # A token tensor is analysed row by row as given: this prompt's real tokens, BOS first.
    run = lensdiv.analyze(model, plugins="lens", data=ids[row : row + 1, :n], progress=False)
    yours = mean_per_layer(kl[:, row : row + 1], mask[row : row + 1], exclude_bos=False)
    print(f"{text!r}")
    print("  yours  ", " ".join(f"{float(v):.4f}" for v in yours))
    print("  lensdiv", " ".join(f"{float(v):.4f}" for v in run["lens"].table()["kl"]))
plt.figure(figsize=(5, 3))
plt.plot(range(L + 1), mine.tolist(), "o-")
plt.xlabel("residual state h_l")
plt.ylabel("KL(p_l ‖ p_out), nats")
plt.title("the logit lens of the toy, by hand")
plt.show()
"""),
    md("**See it per position:** the same grid, every cell a layer and a position, live:"),
    code("print(toy.explore(toy.PROMPTS[0]))"),
]

LESSON_2 = [
    head(
        2,
        "Skip a block",
        "skip block `s` (`h_{s+1} := h_s`) with TransformerLens hooks, then measure how much "
        "every later block's update and the output change — `skip`'s `current` mode.",
        f"[tutorial 2](../02_depth_efficiency.ipynb) and [docs/science.md: skip]({SCIENCE}#skip).",
        "40 minutes",
        "★★☆ (hooks)",
    ),
    code(SETUP),
    md(f"""
## Exercise 2.1 — hooks that skip a block

A hook is `(hook_name, fn)`; TransformerLens calls `fn(tensor, hook)` when the model computes
that activation and uses what `fn` returns in its place. Block `s` reads
`blocks.{{s}}.hook_resid_pre` (`h_s`) and writes `blocks.{{s}}.hook_resid_post` (`h_{{s+1}}`).
Return hooks that replace `h_{{s+1}}` by `h_s` at every position **but BOS** (position 0: never
skipped). `toy.residual_states(model, ids, hooks)` runs with them.

{hints("Save `h_s` in the first hook (a dict in the closure: `saved['h'] = resid.clone()`), use it in the second.", "In the second hook: `out = resid.clone(); out[:, 1:] = saved['h'][:, 1:]; return out`.")}
"""),
    exercise(
        '''
def skip_hooks(s):
    """[(hook name, fn), ...] that set h_{s+1} := h_s at every position but the first."""
''',
        """
    saved = {}

    def save(resid, hook):
        saved["h"] = resid.clone()
        return resid

    def replace(resid, hook):
        out = resid.clone()
        out[:, 1:] = saved["h"][:, 1:]
        return out

    return [(f"blocks.{s}.hook_resid_pre", save), (f"blocks.{s}.hook_resid_post", replace)]
""",
    ),
    code(
        "from lensdiv.course import skipping as check\n\nskip_hooks = check.check_skip_hooks(skip_hooks)"
    ),
    md(f"""
## Exercise 2.2 — the effect on later blocks

For one prompt, `clean` and `skipped` are the states `[L + 1, pos, d_model]` of the two runs.
Block `l`'s update is `Δ_l = h_{{l+1}} − h_l`. Return, for every block `l`,
`E[l] = max over positions of ‖Δ_l − Δ̃_l‖ / max(‖Δ_l‖, 1e-6)` (`~`: the skipped run).

{hints("`d = clean[1:] - clean[:-1]` is every update at once, `[L, pos, d_model]`.", "`.norm(dim=-1)` then `.clamp_min(1e-6)` for the denominator; `.amax(-1)` over positions.")}
"""),
    exercise(
        '''
def update_effect(clean, skipped):
    """E[l] for every block l: the largest relative change of its update over positions."""
''',
        """
    d, e = clean[1:] - clean[:-1], skipped[1:] - skipped[:-1]
    return ((d - e).norm(dim=-1) / d.norm(dim=-1).clamp_min(1e-6)).amax(-1)
""",
    ),
    code("update_effect = check.check_update_effect(update_effect)"),
    md(f"""
## Exercise 2.3 — the effect on the output

`O = max over positions of ‖p − p̃‖₂`, the L2 distance of the output distributions (between 0
and √2), from the two runs' logits `[pos, d_vocab]`.

{hints("`torch.softmax(logits, -1)` first.")}
"""),
    exercise(
        '''
def output_effect(clean_logits, skipped_logits):
    """The largest L2 distance between the two runs' output distributions."""
''',
        """
    p, q = clean_logits.softmax(-1), skipped_logits.softmax(-1)
    return (p - q).norm(dim=-1).amax()
""",
    ),
    code("output_effect = check.check_output_effect(output_effect)"),
    md("""
## The whole sweep

Skip every block in turn on one prompt: the matrix `E[s, l]` (which later blocks change) and the
output effect per skipped block. Zero below the diagonal: skipping `s` cannot change earlier
blocks; one on it: the skipped update is gone.
"""),
    code("""
ids, _ = toy.tokens(model, toy.PROMPTS[0])
logits, clean = toy.residual_states(model, ids)
E = torch.zeros(L, L)
out_effect = torch.zeros(L)
for s in range(L):
    skipped_logits, skipped = toy.residual_states(model, ids, skip_hooks(s))
    E[s] = update_effect(clean[:, 0], skipped[:, 0])
    out_effect[s] = output_effect(logits[0], skipped_logits[0])
fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3))
a.imshow(E, cmap="viridis")
a.set(xlabel="later block l", ylabel="skipped block s", title="E[s, l]")
b.bar(range(L), out_effect.tolist())
b.set(xlabel="skipped block s", ylabel="‖p − p̃‖₂", title="output effect")
plt.tight_layout()
plt.show()
"""),
    md(
        "**See it live:** the explore page reads the model with a block skipped (pick it in *skip*):"
    ),
    code("print(toy.explore(toy.PROMPTS[0], skip=1))"),
]

LESSON_3 = [
    head(
        3,
        "Activation patching",
        "copy one clean activation into a corrupt run and measure how much of the clean answer "
        "comes back; then the map over every layer and position.",
        f"[tutorial 2](../02_depth_efficiency.ipynb) (its patching part) and [docs/science.md: patch]({SCIENCE}#patch).",
        "45 minutes",
        "★★☆ (hooks, caches)",
    ),
    code(SETUP),
    code("""
pair = toy.pair(model)  # a fact of the toy's knowledge base and a corrupted one
clean, corrupt, target, foil = pair["clean"], pair["corrupt"], pair["target"], pair["foil"]
print(pair["text"], "| answer token", target, "| foil", foil, "| tokens", clean.shape[1])
"""),
    md(f"""
## Exercise 3.1 — the metric

The logit difference at the answer position (the last one): `logit[target] − logit[foil]`, one
number per row of `logits [batch, pos, d_vocab]`.

{hints("`logits[:, -1, target] - logits[:, -1, foil]`.")}
"""),
    exercise(
        '''
def logit_diff(logits, target, foil):
    """logit[target] - logit[foil] at the last position, per row."""
''',
        """
    return logits[:, -1, target] - logits[:, -1, foil]
""",
    ),
    code(
        "from lensdiv.course import patching as check\n\nlogit_diff = check.check_logit_diff(logit_diff)"
    ),
    md(f"""
## Exercise 3.2 — one patch

Run the **corrupt** prompt with `h_layer` (`blocks.{{layer}}.hook_resid_pre`) at position `pos`
replaced by the **clean** run's; return the patched run's logits.

{hints("`_, cache = model.run_with_cache(clean)`; `cache[name]` is the clean activation.", "`model.run_with_hooks(corrupt, fwd_hooks=[(name, fn)])`, with `fn` copying `h[:, pos]` in (clone first).")}
"""),
    exercise(
        '''
def patch_run(model, clean, corrupt, layer, pos):
    """Logits of the corrupt run with the clean h_layer patched in at position pos."""
''',
        """
    name = f"blocks.{layer}.hook_resid_pre"
    _, cache = model.run_with_cache(clean)

    def patch(resid, hook):
        out = resid.clone()
        out[:, pos] = cache[name][:, pos]
        return out

    return model.run_with_hooks(corrupt, fwd_hooks=[(name, patch)])
""",
    ),
    code("patch_run = check.check_patch_run(patch_run)"),
    md(f"""
## Exercise 3.3 — the full map

For every layer `l` and position `t`: `(m_patched − m_corrupt) / (m_clean − m_corrupt)`, with `m`
the logit difference. 0: the patch changes nothing; 1: it restores the clean answer. Return
`[n_layers, pos]`.

{hints("`m_clean = float(logit_diff(model(clean), target, foil)[0])`, likewise `m_corrupt`.", "Two loops, over `range(model.cfg.n_layers)` and `range(clean.shape[1])`, calling your `patch_run`.")}
"""),
    exercise(
        '''
def patching_map(model, clean, corrupt, target, foil):
    """The normalised patching score of h_l at every (layer, position): [n_layers, pos]."""
''',
        """
    m_clean = float(logit_diff(model(clean), target, foil)[0])
    m_corrupt = float(logit_diff(model(corrupt), target, foil)[0])
    out = torch.zeros(model.cfg.n_layers, clean.shape[1])
    for layer in range(model.cfg.n_layers):
        for pos in range(clean.shape[1]):
            m = float(logit_diff(patch_run(model, clean, corrupt, layer, pos), target, foil)[0])
            out[layer, pos] = (m - m_corrupt) / (m_clean - m_corrupt)
    return out
""",
    ),
    code("patching_map = check.check_patching_map(patching_map)"),
    code("""
with torch.no_grad():
    scores = patching_map(model, clean, corrupt, target, foil)
labels = [model.tokenizer.decode([t]) for t in clean[0].tolist()]
plt.figure(figsize=(6, 2.8))
plt.imshow(scores, cmap="RdBu", vmin=-1, vmax=1)
plt.xticks(range(len(labels)), labels)
plt.xlabel("position")
plt.ylabel("h_l")
plt.colorbar(label="restored")
plt.title("patching clean → corrupt")
plt.show()
"""),
    md("**See it live:** the explore page's *Patch* tab draws the same map for any pair:"),
    code('print(toy.explore(pair["text"][0], corrupt=pair["text"][1]))'),
]

LESSON_4 = [
    head(
        4,
        "The layers as an ensemble",
        "split the model's logits into its members' predictions (the embedding and every "
        "attention and MLP write), compute bias and diversity in both forms, and see the identity "
        "ensemble error = bias − diversity hold.",
        f"[tutorial 3](../03_layers_as_ensemble.ipynb) and [docs/science.md: bias]({SCIENCE}#bias).",
        "35 minutes",
        "★★☆",
    ),
    code(SETUP),
    code("""
f, y = toy.member_predictions(model, toy.PROMPTS[0])  # [M, n, d_vocab] and the next tokens [n]
print("members", f.shape[0], "| positions", f.shape[1], "| their mean is the model's logits")
"""),
    md(f"""
## Exercise 4.1 — the squared-error form

With `z = mean_i f_i` and `y` one-hot: return the means over positions of the ensemble error
`‖z − y‖²`, the bias `(1/M) Σ_i ‖f_i − y‖²` and the diversity `(1/M) Σ_i ‖f_i − z‖²`.

{hints("`onehot = torch.nn.functional.one_hot(y, f.shape[-1]).to(f.dtype)`.", "`(f - onehot).pow(2).sum(-1)` is `[M, n]`: `.mean()` over both is the bias.")}
"""),
    exercise(
        '''
def squared_terms(f, y):
    """(ensemble error, bias, diversity) of the squared error, each a mean over positions."""
''',
        """
    z = f.mean(0)
    onehot = torch.nn.functional.one_hot(y, f.shape[-1]).to(f.dtype)
    ens = (z - onehot).pow(2).sum(-1).mean()
    bias = (f - onehot).pow(2).sum(-1).mean()
    div = (f - z).pow(2).sum(-1).mean()
    return ens, bias, div
""",
    ),
    code(
        "from lensdiv.course import ensemble as check\n\nsquared_terms = check.check_squared_terms(squared_terms)"
    ),
    md(f"""
## Exercise 4.2 — the cross-entropy form

With `q_i = softmax(f_i)` and `p = softmax(z)`: the ensemble's `CE(y, p)`, the members' mean
`(1/M) Σ_i CE(y, q_i)` and the diversity `(1/M) Σ_i KL(p ‖ q_i)`, each a mean over positions.

{hints("`logq = f.log_softmax(-1)`, `logp = f.mean(0).log_softmax(-1)`.", "`-logq[:, torch.arange(len(y)), y]` is every member's CE; `(logp.exp() * (logp - logq)).sum(-1)` every KL.")}
"""),
    exercise(
        '''
def ce_terms(f, y):
    """(ensemble CE, mean member CE, mean KL(p || q_i)), each a mean over positions."""
''',
        """
    logq = f.log_softmax(-1)
    logp = f.mean(0).log_softmax(-1)
    rows = torch.arange(len(y))
    ens = -logp[rows, y].mean()
    ce = -logq[:, rows, y].mean()
    kl = (logp.exp() * (logp - logq)).sum(-1).mean()
    return ens, ce, kl
""",
    ),
    code("ce_terms = check.check_ce_terms(ce_terms)"),
    md(
        "## The identity\n\nBoth forms: the ensemble's error is exactly the members' mean error minus their diversity."
    ),
    code("""
for name, terms in (("squared", squared_terms(f, y)), ("cross-entropy", ce_terms(f, y))):
    ens, bias, div = (float(t) for t in terms)
    print(f"{name:14} ensemble {ens:10.4f} = bias {bias:10.4f} − diversity {div:10.4f}  (gap {ens - (bias - div):+.1e})")
sq = [float(t) for t in squared_terms(f, y)]
plt.figure(figsize=(4, 3))
plt.bar(["ensemble", "bias", "diversity"], sq)
plt.title("squared error")
plt.show()
"""),
]

LESSON_5 = [
    head(
        5,
        "Remove a range of blocks",
        "remove blocks `ℓ..ℓ+n−1` and measure the true cost, then the cheap signals papers use to "
        "pick what to remove (block influence, angular distance), and see where a proxy picks "
        "the wrong block.",
        f"[tutorial 7](../07_depth_surgery.ipynb) and [docs/science.md: prune]({SCIENCE}#prune).",
        "45 minutes",
        "★★☆",
    ),
    code(SETUP),
    md(f"""
## Exercise 5.1 — hooks that remove blocks

Return hooks that set `h_{{ℓ+n}} := h_ℓ` at **every** position, BOS included (the blocks are gone;
compare lesson 2's skip, which spares BOS). The check runs the model with your hooks and compares
`h_0 .. h_ℓ`, `h_{{ℓ+n}} .. h_L` and so the output; what the states inside the removed range hold
is up to you.

{hints("Save at `blocks.{start}.hook_resid_pre`, replace at `blocks.{start + n - 1}.hook_resid_post`.")}
"""),
    exercise(
        '''
def remove_hooks(start, n):
    """Hooks that remove blocks start .. start + n - 1 at every position."""
''',
        """
    saved = {}

    def save(resid, hook):
        saved["h"] = resid.clone()
        return resid

    def replace(resid, hook):
        return saved["h"].clone()

    return [(f"blocks.{start}.hook_resid_pre", save), (f"blocks.{start + n - 1}.hook_resid_post", replace)]
""",
    ),
    code(
        "from lensdiv.course import removal as check\n\nremove_hooks = check.check_remove_hooks(remove_hooks)"
    ),
    md(f"""
## Exercise 5.2 — block influence (ShortGPT)

`BI_j = 1 − cos(h_j, h_{{j+1}})`, averaged over the real tokens of the batch: one number per block
from `states [L + 1, batch, pos, d_model]` and `mask`.

{hints("`torch.nn.functional.cosine_similarity(states[:-1], states[1:], dim=-1)` is `[L, batch, pos]`.", "Then `(1 - c)[:, mask].mean(-1)`.")}
"""),
    exercise(
        '''
def block_influence(states, mask):
    """1 - cos(h_j, h_{j+1}) averaged over real tokens, per block j."""
''',
        """
    c = torch.nn.functional.cosine_similarity(states[:-1].double(), states[1:].double(), dim=-1)
    return (1 - c)[:, mask].mean(-1)
""",
    ),
    code("block_influence = check.check_block_influence(block_influence)"),
    md(f"""
## Exercise 5.3 — angular distance (Gromov et al.)

`d(ℓ, n) = arccos(cos(h_ℓ, h_{{ℓ+n}})) / π` at the **last real token** of each row, averaged over
rows.

{hints("The last real token of row `r` is at `mask[r].sum() - 1` (rows are right-padded).", "Clamp the cosine to [−1, 1] before `torch.arccos`.")}
"""),
    exercise(
        '''
def angular_distance(states, mask, start, n):
    """arccos(cos(h_start, h_{start+n})) / pi at each row's last real token, mean over rows."""
''',
        """
    rows = torch.arange(mask.shape[0])
    last = mask.sum(1) - 1
    a, b = states[start][rows, last].double(), states[start + n][rows, last].double()
    c = torch.nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1, 1)
    return (torch.arccos(c) / torch.pi).mean()
""",
    ),
    code("angular_distance = check.check_angular_distance(angular_distance)"),
    md("""
## True cost against the signals

For every single block (`n = 1`): the true KL of the output after removing it (lesson 1's KL,
here with lensdiv's readout), its block influence and its angular distance. A signal is right
when its smallest value marks the block that truly costs least.
"""),
    code("""
from lensdiv.course.logit_lens import kl_to_output

ids, mask = toy.tokens(model, toy.PROMPTS)
logits, states = toy.residual_states(model, ids)
true = []
for start in range(L):
    removed_logits, _ = toy.residual_states(model, ids, remove_hooks(start, 1))
    true.append(float(kl_to_output(removed_logits, logits)[mask].mean()))
bi = block_influence(states, mask)
ang = [float(angular_distance(states, mask, s, 1)) for s in range(L)]
print("true KL   ", [round(v, 3) for v in true], "→ remove block", min(range(L), key=true.__getitem__))
print("BI        ", [round(float(v), 3) for v in bi], "→ picks block", int(bi.argmin()))
print("angular   ", [round(v, 3) for v in ang], "→ picks block", min(range(L), key=ang.__getitem__))
fig, axes = plt.subplots(1, 3, figsize=(11, 2.8))
panels = (("true KL", true), ("block influence", bi.tolist()), ("angular distance", ang))
for ax, (title, v) in zip(axes, panels, strict=True):
    ax.bar(range(L), v)
    ax.set(title=title, xlabel="block removed")
plt.tight_layout()
plt.show()
"""),
    md(
        "**Why a proxy can pick wrong:** BI and the angle look at the state's *direction* only; the readout also depends on what the later blocks do with the changed state. `lensdiv analyze toy --plugins prune` measures every range and reports each signal's regret."
    ),
]

LESSON_6 = [
    head(
        6,
        "A translator for one layer (the tuned lens)",
        "fit an affine map from `h_l` to `h_L` by least squares, read `h_l` through it, then "
        "train the tuned lens' translator by a few SGD steps on its own loss, and compare both "
        "with the logit lens' KL.",
        f"[tutorial 6](../06_fitted_lenses.ipynb), [docs/science.md: tuned lens]({SCIENCE}#tuned-lens) and [fit-affine]({SCIENCE}#fit-affine).",
        "45 minutes",
        "★★★ (least squares, autograd)",
    ),
    code(SETUP),
    code("""
from lensdiv.course.logit_lens import kl_to_output, lens_logits
from lensdiv.course.translator import TEXTS

LAYER = 1
ids, mask = toy.tokens(model, TEXTS)
logits, states = toy.residual_states(model, ids)
keep = mask.clone()
keep[:, 0] = False  # real tokens, BOS left out
h, h_last, out = states[LAYER][keep], states[-1][keep], logits[keep]
params = toy.readout_params(model)
print(f"{h.shape[0]} positions of h_{LAYER}")
"""),
    md(f"""
## Exercise 6.1 — the affine translator by least squares

Find `W [d, d]` and `c [d]` minimising `Σ ‖h W + c − h_L‖²` over the positions.

{hints("Append a column of ones to `h`: `x = torch.cat([h, torch.ones(len(h), 1)], 1)`.", "`sol = torch.linalg.lstsq(x.double(), target.double()).solution`; `W, c = sol[:-1], sol[-1]`.")}
"""),
    exercise(
        '''
def fit_translator(h, target):
    """(W, c) minimising the squared error of h @ W + c against target."""
''',
        """
    x = torch.cat([h, torch.ones(len(h), 1, dtype=h.dtype)], 1).double()
    sol = torch.linalg.lstsq(x, target.double()).solution
    return sol[:-1], sol[-1]
""",
    ),
    code(
        "from lensdiv.course import translator as check\n\nfit_translator = check.check_fit_translator(fit_translator)"
    ),
    md(f"""
## Exercise 6.2 — the tuned lens' loss

The tuned lens' translator is `T(h) = h + h A + b` (`A = 0, b = 0` is the logit lens) and it is
trained to minimise the mean over positions of `KL(p_out ‖ p_T)` — the output first, the
opposite of the direction the logit lens reports. Use `lens_logits` from lesson 1 (imported
above). Return the loss as a tensor with its gradient: the cell after trains `A` and `b` with
`loss.backward()`.

{hints("`logits = lens_logits(h + h @ A + b, **params)`.", "`lp, lq = out_logits.log_softmax(-1), logits.log_softmax(-1)`; `(lp.exp() * (lp - lq)).sum(-1).mean()`.")}
"""),
    exercise(
        '''
def tuned_loss(A, b, h, out_logits, params):
    """Mean KL(p_out || p_T) of the translator T(h) = h + h @ A + b."""
''',
        """
    logits = lens_logits(h + h @ A + b, **params)
    lp, lq = out_logits.log_softmax(-1), logits.log_softmax(-1)
    return (lp.exp() * (lp - lq)).sum(-1).mean()
""",
    ),
    code("tuned_loss = check.check_tuned_loss(tuned_loss)"),
    md(
        "## Three readings of one layer\n\nThe logit lens, the least-squares translator, and a few SGD steps on your loss (from the identity), each as the KL the logit lens reports, `KL(p_T ‖ p_out)`, on the fitted positions."
    ),
    code("""
def reported_kl(states_in):
    return float(kl_to_output(lens_logits(states_in, **params), out).mean())

W, c = fit_translator(h, h_last)
A = torch.zeros(h.shape[1], h.shape[1], requires_grad=True)
b = torch.zeros(h.shape[1], requires_grad=True)
opt = torch.optim.Adam([A, b], lr=1e-2)
losses = []
for _ in range(10 if FAST else 200):
    opt.zero_grad()
    loss = tuned_loss(A, b, h, out, params)
    loss.backward()
    opt.step()
    losses.append(float(loss))
with torch.no_grad():
    readings = {
        "logit lens": reported_kl(h),
        "least squares": reported_kl((h.double() @ W + c).float()),
        "SGD on the tuned loss": reported_kl(h + h @ A + b),
    }
for name, v in readings.items():
    print(f"{name:22} KL {v:.4f} nats")
fig, (a, b_) = plt.subplots(1, 2, figsize=(9, 3))
a.plot(losses)
a.set(xlabel="step", ylabel="tuned loss (nats)")
b_.bar(list(readings), list(readings.values()))
b_.set(ylabel="KL(p_T ‖ p_out)")
plt.tight_layout()
plt.show()
"""),
    md(
        "`lensdiv lenses fit toy --kind tuned` trains every layer's translator this way (from the least-squares start, by SGD with Nesterov momentum); `--lens tuned:OUT` reads any analysis through it."
    ),
]

LESSON_7 = [
    head(
        7,
        "Write an analyzer plugin",
        "turn a measurement into an analyzer — options, hooks, a state that merges, "
        "`finalize` — that passes `check_analyzer`, and run it beside the built-in ones.",
        "[tutorial 5](../05_write_your_own_analyzer.ipynb) and ARCHITECTURE.md (*The analyzer contract*).",
        "40 minutes",
        "★★☆",
    ),
    code(SETUP),
    md(f"""
## Exercise 7.1 — `ResidNorms`

The mean norm `‖h_l‖` of every residual state `h_0 .. h_L` over the real tokens (BOS left out
when `exclude_bos`), as a table `resid_norms` with columns `layer` and `mean_norm`.

- `hooks(info)`: `[info.resid(l) for l in range(info.n_layers + 1)]`;
- `update(state, step)`: add **sums and a count** to the state (`state.add(name, tensor)`),
  never a mean: two shards' states must add up to the whole's;
- `finalize(state, info)`: divide, then build the `Result`.

{hints("`keep = step.batch.positions(exclude_bos=self.exclude_bos)` is True at real tokens.", "`state.add(f'sum{layer}', step.resid(layer)[keep].norm(dim=-1).sum())` per layer and `state.add('n', keep.sum())`.", "In `finalize`: `layers = list(range(info.n_layers + 1))`, `mean = [float(state[f'sum{layer}'] / state['n']) for layer in layers]`, then `Result(self.name, tables={'resid_norms': Table('resid_norms', {'layer': layers, 'mean_norm': mean})})`.")}
"""),
    exercise(
        '''
from dataclasses import dataclass

from lensdiv import Analyzer, Result, Table


@dataclass(frozen=True)
class ResidNorms(Analyzer):
    """Mean norm of every residual state h_0 .. h_L over the real tokens.

    Args:
        exclude_bos: Leave the BOS position out.
    """

    name = "resid-norms"
    description = "Mean norm of every residual state"
    exclude_bos: bool = True

    def hooks(self, info):
        return [info.resid(layer) for layer in range(info.n_layers + 1)]

    def update(self, state, step):
''',
        """
        keep = step.batch.positions(exclude_bos=self.exclude_bos)
        for layer in range(step.info.n_layers + 1):
            state.add(f"sum{layer}", step.resid(layer)[keep].double().norm(dim=-1).sum())
        state.add("n", keep.sum())

    def finalize(self, state, info):
        layers = list(range(info.n_layers + 1))
        mean = [float(state[f"sum{layer}"] / state["n"]) for layer in layers]
        table = Table("resid_norms", {"layer": layers, "mean_norm": mean})
        return Result(self.name, tables={"resid_norms": table}, summary=f"‖h_L‖ = {mean[-1]:.2f}")
""",
        stub="""
    def finalize(self, state, info):
        raise NotImplementedError  # and here: divide the sums by the count, build the Result
""",
    ),
    code(
        "from lensdiv.course import plugin as check\n\nNorms = check.check_plugin(ResidNorms)  # yours once it passes, lensdiv's until then"
    ),
    md(
        "## Exercise 7.2 — the contract\n\n`check_analyzer` runs your class on a tiny model: two halves of the data merged must equal one run, pads must never count, the state must survive a round trip to disk, the result must render. The check says in one line what broke."
    ),
    code("check.check_contract(ResidNorms)"),
    md(
        "## Beside the built-ins\n\n`lensdiv.analyze` (what `lensdiv analyze` calls) runs it in the same forward pass as `lens` and `contrib`:"
    ),
    code("""
import lensdiv

run = lensdiv.analyze(model, plugins=[Norms(), "lens", "contrib"], max_tokens=512 if FAST else 8192, progress=False)
norms = run["resid-norms"].table()
plt.figure(figsize=(5, 3))
plt.plot(norms["layer"], norms["mean_norm"], "o-")
plt.xlabel("h_l")
plt.ylabel("mean ‖h_l‖")
plt.show()
print(run["lens"].summary)
"""),
    md("""
**On the command line.** A plugin is a package with one entry point: `lensdiv plugins new
resid-norms` scaffolds it (put your class in its module), `pip install -e` it, and then

```console
lensdiv analyze toy --plugins resid-norms,lens,contrib
```

runs it beside the built-ins, and `lensdiv plugins show resid-norms` prints its options.
Tutorial 5 walks through the install.
"""),
]

LESSONS = [
    ("01_logit_lens", LESSON_1),
    ("02_skip_a_block", LESSON_2),
    ("03_activation_patching", LESSON_3),
    ("04_bias_diversity", LESSON_4),
    ("05_remove_blocks", LESSON_5),
    ("06_tuned_translator", LESSON_6),
    ("07_analyzer_plugin", LESSON_7),
]
