"""Token-pass formulas the kinds' cost estimates share (compute/jobs/<kind>.py `cost`).

Unit: a token-pass is one token through one forward pass; a backward pass counts as two forward
passes (a gradient step over a sequence of L tokens is 3 L token-passes). app/limits.py
multiplies a kind's token-passes by the parameters of the largest model the spec names. The
token-pass counts (the cost ceiling's unit) count every prompt as `COST_PROMPT_TOKENS` tokens
(GSM8K-style jsonl prompts are about that many: an upper bound for the arithmetic tasks); the
time and memory estimates below count the task's own prompt length (`Sizing.prompt_tokens`,
compute.contract.tasknames.prompt_tokens: "12+34=" is 7 tokens at most), because a 64-token
guess made SmolLM2-135M's default Fisher estimate 2.8x its measured time. Every completion
counts as `max_new_tokens` (sampling may stop early).

Pure: no imports beyond the standard library (the web process estimates with it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

COST_PROMPT_TOKENS = 64


def read_calibration(path: str | Path) -> tuple[float, float, str] | None:
    """(a, b, device it was measured on) of a calibration file (`fisherlens calibrate` writes it,
    compute/lm/calibrate.py: seconds = token-passes x (a + b x params)), or None when the file is
    missing, unreadable, without both numbers or with a < 0 or b <= 0. The one reader: the web's
    estimate (app/ceiling.py) and a worker deciding whether to calibrate (compute/worker/device.py)."""
    try:
        data = json.loads(Path(path).read_text())
        a, b = float(data["seconds_per_token_pass"]), float(data["seconds_per_param_token_pass"])
        device = str(data.get("device", ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return (a, b, device) if a >= 0 and b > 0 else None


def fisher_passes(prompts: int, samples: int, max_new_tokens: int, estimator: str = "sequence",
                  exact_output: bool = False) -> int:
    """A Fisher estimate: sampling (KV cache), one backward per sequence (per completion token
    for the `token` estimator: its naive cost; the batched engine is faster), and one more
    forward per sequence for the exact output-layer check."""
    seqs = prompts * samples
    length = COST_PROMPT_TOKENS + max_new_tokens
    sample = 0 if estimator == "empirical" else seqs * length  # generation (KV cache)
    grads = seqs * length * 3 * (max_new_tokens if estimator == "token" else 1)
    exact = seqs * length if exact_output else 0
    return sample + grads + exact


def train_passes(algo: str, steps: int, batch: int, group: int, max_new_tokens: int,
                 eval_prompts: int, checkpointing: bool = False) -> int:
    """One training run: per step a gradient over every sequence (one more forward with gradient
    checkpointing), sampling (not for SFT) and a teacher forward (OPD); greedy held-out accuracy
    before and after."""
    length = COST_PROMPT_TOKENS + max_new_tokens
    seqs = batch * (1 if algo == "sft" else group)
    grad = 4 if checkpointing else 3
    per_seq = grad + (0 if algo == "sft" else 1) + (1 if algo == "opd" else 0)  # grad, sample, teacher
    evals = 2 * eval_prompts * length  # greedy accuracy before and after
    return steps * seqs * length * per_seq + evals


# ---------------------------------------------------------------- time and memory (issue 27, 30)
#
# The token-passes above price the arithmetic. What a job takes on the clock and in memory also
# has parts that do not scale with token-passes: loading the model, generation being one call
# per new token (a tiny model's decode step is all call overhead), the statistics and files a
# job writes. Each kind's `timing` and `memory` (compute/jobs/<kind>.py) adds those parts up
# from a `Sizing` (the model's config and this machine's calibration); app/limits.py calls them.
# The constants below are named and measured (benchmarks/bench_estimates.py): change one when a
# runner changes, and rerun the benchmark.

MIB = 2**20

# Wall time. A "call" is the fixed part of one forward+backward call of the calibration
# (compute/lm/calibrate.py: a x its 3 x 8 x 48 token-passes): what a tiny model's call costs, and
# the unit the per-call overheads below are counted in, so they move with the machine.
CALL_TOKEN_PASSES = 3 * 8 * 48
# from_pretrained + tokenizer + task set-up of a job, before any weight bytes, in calls (so it moves
# with the machine like the other fixed parts; it was 5.0 s, fitted at a load average of 7): 370
# calls = 5.5 s under that run's calibration, 1.8 s under the quiet one of issue 30's re-measurement
# (measured 1.95 s for arith-base, 2.3 s for SmolLM2-135M with its 540 MB of weights)
MODEL_LOAD_CALLS = 370.0
LOAD_BYTES_PER_S = 400e6  # reading safetensors weights into the model (CPU, page cache warm)
# a model loaded again in the same process (a sweep's points): the imports, the tokenizer and the
# classes are warm; its weights are read again (arith-base: 24 ms a point, 5 calls at that run's
# calibration; bench_estimates.json, session 19)
MODEL_RELOAD_CALLS = 5.0
# one generation step (sampling, logits processors, KV cache update) per decoder layer: a decode
# step's fixed part grows with the layers it runs through (benchmarks/bench_estimate_parts.py,
# results/bench_estimate_parts.json, CPU, 2 threads, 8 and 64 rows: arith-base, 2 layers,
# 0.31-0.36 calls; arith-deep-base, 8 layers, 0.84-1.10; SmolLM2-135M, 30 layers, 17.7-23.7 with a
# test run beside it, 8.5-11.6 alone in an uncommitted run). It was 2.0 calls whatever the depth
DECODE_STEP_CALLS_PER_LAYER = 0.25
# per-sample gradient of one row, its fixed part beyond the batched backward it shares (the engine
# runs many rows a forward since issue 30: arith-base's 256 rows took 0.23 s, 0.1 calls a row; session 19)
FISHER_ROW_CALLS = 0.1
# per-row backward arithmetic vs the calibration's batched one: 2.0 when issue 30 measured the engine
# at 1.69-2.20x its floor; SmolLM2-135M's default and held-out Fishers measured 1.33 / 1.25 with the
# engine at 1.3x (bench_estimates.json, session 19; 1.29 from the default row alone, its per-sample
# passes without the self-check)
FISHER_ROW_PASS_FACTOR = 1.29
# the engine's self-check (compute.fisher.estimators._verify): CHECK_ROWS rows' positions forward and
# one forward + backward, its fixed part, and the comparison over every parameter (SmolLM2-135M:
# 1.84 s, 0.5 s of it the rows' passes; arith-base 0.035 s; session 19)
CHECK_ROWS = 2
CHECK_CALLS = 2.0
CHECK_CALLS_PER_PARAM = 1.2e-6
EXACT_ROW_CALLS = 0.02  # exact output-layer Fisher of one row (arith-base: 256 rows in 0.074 s, session 19; was 0.6)
# the bound check's per-sample gradient of one row (full gradient, kept): its fixed part per decoder
# layer. It was 15 calls whatever the depth, fitted at 6-16 layers: 9x the clock on the 2-layer zoo
# model. Refitted with the fold below on bench_bound_time.json's one-group rows (20M / 50M / 106M,
# 6 / 8 / 16 layers: each row's backward and fold 0.96 / 0.94 / 1.06x the estimate) and the zoo
# model's GRPO train (session 19)
BOUND_ROW_CALLS_PER_LAYER = 1.7
# The bound check's per-coordinate work (benchmarks/bench_bound_time.py, 20M / 50M / 106M Llama,
# CPU, 2 threads; results/bench_bound_time.json): each row's gradient folded into two float64 sums
# beyond the rows' backward (a float32 slice cast once, then same-dtype arithmetic), the summary's
# one pass and its end (the rank correlations of a 2M-coordinate sample, the exact quantiles), in
# calls (the machine's unit) at that run's calibration. They were counted nowhere: the estimate was
# 13x short at 100M (1.4 s against 18 s measured, before the fold and the summary were made 1.4x
# and 2.7x faster: results/bench_bound_time_207abbd.json). A group after the first repeats the rows'
# backward only above its earliest parameter: BOUND_GROUP_BACKWARD_SHARE of a whole one (measured
# 0.44-0.66). With them the estimate is within the ratios the file records.
BOUND_FOLD_CALLS_PER_PARAM_ROW = 5.0e-7
BOUND_SUMMARY_CALLS_PER_PARAM = 4.3e-6
# the summary's end, at BOUND_CORR_COORDS coordinates or more: its rank correlations run over a
# sample of that many (compute.studies.bound), fewer on a smaller model, and its time with them
BOUND_SUMMARY_CALLS = 90.0
BOUND_CORR_COORDS = 2_000_000
BOUND_GROUP_BACKWARD_SHARE = 0.6
TRAIN_STEP_CALLS = 2.0  # an optimizer step: objective, backward, clip, step, bookkeeping
# a Fisher's statistics over all parameters (split-half, Gini, curve, tables), in calls per
# parameter: streaming since issue 30, 5.2 s for SmolLM2-135M (was 2.4e-7 s/param, ~32 s); refitted
# in session 18 after the statistics' fewer operations a value: 3.07-3.31 s measured for
# SmolLM2-135M against 15.5 s at 7.9e-6 with the same calibration (bench_estimates.json)
STATS_CALLS_PER_PARAM = 1.7e-6
# a train's end (the base checked against its file, update sparsity, concentration, the model and
# its metrics saved), in calls (the machine's unit) and calls per parameter. It was 10 s + 3e-7
# s/param, seconds that do not move with the machine: 10 s where arith-base's end takes 0.99
# and 0.91 s in two runs that day, 210 and 111 calls at their calibrations; a sweep point's 0.66 and
# 0.82 s, 140 and 100: bench_estimates.json, session 19); the per-parameter part is the old 3e-7 s
# at the calibration it was fitted under (14.6 ms a call)
TRAIN_FINISH_CALLS = 150.0
TRAIN_FINISH_CALLS_PER_PARAM = 2e-5
# retention keeps the loaded models, the Fisher, the seed-independent masks and every arm's
# curves and held-out rewards in one process
RETENTION_STATE_MB = 200.0
# Jobs over tensor files, in calls too (they were seconds, fitted at a call of 15 ms, and did not
# move with the machine). Refitted in session 19 by the parts the jobs now report (arith-base's
# default diff and series; a SmolLM2-135M diff against a perturbed copy of it: open 0.04 s,
# compare 5.1 s, spectra 5.6 s at a call of 4.5 ms):
FILE_JOB_CALLS = 2.0  # a job over tensor files: opening, the result, its figures data
# a series' reading of the run folder and references (first imports included: 0.1-0.5 s between
# runs of arith-base's default series, of which 0.04 s comparing)
SERIES_OPEN_CALLS = 15.0
CHECKPOINT_CALLS_PER_PARAM = 3.25e-6  # diff / series: reading and comparing one checkpoint, per parameter
CHECKPOINT_CALLS_PER_TENSOR = 0.94  # diff: each tensor's statistics (counts, histogram, top shares)
# diff: the linear-algebra workspace of the spectra (LAPACK, its first use): arith-base's diff
# peaks at 28-29 MiB whatever its size (was 4)
DIFF_SPECTRA_MB = 16.0
DIFF_BYTES_PER_LARGEST = 6.0  # diff: the largest tensor's two sides and its chunks' temporaries
# diff: the singular values of each 2-D delta up to diff.SVD_MAX_NUMEL elements: a fixed part a
# matrix (arith-base's 16 took 6 ms) and min(m, n)^2 max(m, n) multiply-adds at this many times the
# calibration's arithmetic per parameter-token-pass (SmolLM2-135M's 210: 5.6 s)
DIFF_CALLS_PER_MATRIX = 0.06
DIFF_SVD_PASSES = 4.8
SVD_MAX_NUMEL = 16_000_000  # compute.sparsity.diff.SVD_MAX_NUMEL, the diff's default
MASK_SELECT_CALLS = 1.0  # mask: selecting from a Fisher (per-tensor thresholds, statistics)
MASK_CALLS_PER_ELEMENT = 1.33e-6
# the token explorer: one backward per token it traces, and its forward over the context and the
# factored-gradient check (were 1.2 and 240 calls: the default tokens job's sensitivities took 0.05 s
# beside a 2.1 s load, estimated 3.1 s; refitted on its parts, session 19)
TOKEN_GRAD_CALLS = 0.05
TOKEN_SETUP_CALLS = 5.0
# A half-precision Fisher's float32 check (compute/jobs/fisher_run.py precision_check_plan) runs
# within what the job's allowance leaves, with at least this temporaries budget, else it is
# skipped and the result says why (issue 30)
PRECISION_CHECK_MIN_TEMPORARIES_MB = 32
# Memory (bytes above the process's RSS before the job)
RUNTIME_BASE_MB = 175.0  # a model-running job's first forward/backward/generate (allocator, kernels)
FILE_JOB_BASE_MB = 11.0  # a job that only reads tensor files (mask from a Fisher, ...)
# A Fisher job beyond its weights and temporaries: the exact float32 sum of squares over both
# halves (4 B) and the int16 fraction of it that holds the half difference (2 B); the self-check,
# the per-row buffers and the statistics stream within the temporaries budget (issue 30; measured
# 4.0 B/param beyond the budget at 50M, 0.7 at 7M: benchmarks/bench_scale.py, test_fisher_memory)
FISHER_BYTES_PER_PARAM = 6.0
# A dense training run (every coordinate trained), per parameter of the model: every gradient
# alive from the backward to the step (4) and the optimizer step's temporaries over whole tensors
# (8); the concentration sums (g^2 and |g|: 8) when concentration is on. Fitted before issue 30 on
# the zoo's 100k-parameter model (errs towards refusing) as 16 with the initial Fisher's 4 in it, on
# a CPU: issue 30 counts that 4 apart (train_memory's "initial Fisher", initial_fisher_device_bytes),
# so a CPU's figures are the fitted ones and a GPU's leave out the Fisher the job keeps on the host.
TRAIN_BYTES_PER_PARAM = 12.0
CONCENTRATION_BYTES_PER_PARAM = 8.0
# The optimizer's state per *trained* coordinate (AdamW: two fp32 moments; SGD with momentum:
# one): masked training keeps it at the mask's coordinates only (compute/train/optimizers.py).
OPTIMIZER_BYTES_PER_TRAINED_COORD = {"adamw": 8.0, "sgd": 4.0}
# A masked run (issue 30 item 4, compute/train/optimizers.py) holds per *trained* coordinate its
# folded float32 gradient (4) and its int32 index in the compact mask (4); a linear layer's or an
# embedding's weight gradient is never dense (a block of FOLD_BLOCK_BYTES of its rows at a time,
# compute.train.optimizers._fold_uses), another tensor's only while autograd accumulates it; the
# mask file, the base check and the diff read a chunk of rows at a time, never a whole tensor; the
# concentration sums are kept at the trained coordinates; the initial Fisher, when the run needs
# one (a given Fisher file, the concentration report, GRPO's bound), is a float32 tensor per
# parameter (4). Measured: docs/scale.md, "The masked step at scale".
MASKED_BYTES_PER_TRAINED_COORD = 8.0
FOLD_BLOCK_BYTES = 8 << 20
# Float32 logits of one chunk of tokens through the output head in the training objectives
# (compute.lm.head): the whole (rows, length, vocab) logits are never held, a chunk is recomputed in
# backward. Chosen side by side (benchmarks/bench_logits.py, 20m Llama shape, 49,152 vocab, 8 x 256
# tokens, CPU): 8 MiB chunks cost 1.6-1.7x the full-logits step's time (the head's weight is read
# again for every 42-token chunk), 32 MiB 1.3x, 128 MiB 1.2x (the recompute: this model's head is
# 73% of its arithmetic, an 8B model's under 10%). With the fused target log-prob (one gradient
# in place, no log_softmax output) the 128 MiB step is 0.72-1.15x the full path's time (noise) and
# holds 0.30x its peak at 8 x 512 tokens (869 vs 2853 MiB; bench_logits.json).
LOGITS_CHUNK_BYTES = 128 << 20
INITIAL_FISHER_BYTES_PER_PARAM = 4.0
# GRPO's Cauchy-Schwarz bound check on the first batch (compute.studies.bound, on by default): two
# float64 sums per coordinate of a group (16 bytes/param), each row's gradient folded in as
# autograd finishes it, and a summary streamed over slices in one pass. Fitted to
# benchmarks/results/bench_bound_groups.json (fresh process, 8 completions of 8 tokens, the
# independent Fisher already held; 20M / 50M / 106M, one group and groups of a quarter and a tenth):
# the one-group peak grows 15.9-16.3 bytes/param between sizes; with BOUND_FIXED_MB and one float32
# gradient of the largest parameter (groups) the estimate is 1.03-1.39x every measured peak.
# Before issue 30's session 15 the check took 143-149 bytes/param and was counted in no estimate;
# session 15's two-pass summary 52 / 34 / 30.5 at those sizes (bench_bound_memory.json), this
# code 47.5 / 27.4 / 21.5 in one group.
BOUND_BYTES_PER_PARAM = 20.0


# What the bound check holds beside its per-coordinate sums, whatever the model's size: its
# summary's samples (2M coordinates for the correlations, three float64 values each, drawn with
# twice that many candidates), the ratio's and the grid's fine histograms (8 MiB each), a slice's
# float64 temporaries, the sampled batch and one row's forward+backward. Measured as the peak less
# BOUND_BYTES_PER_PARAM x the largest group less its largest gradient: 148-624 MiB over the nine
# measurements of bench_bound_groups.json (more in groups: the samples and histograms outlive a
# group's sums, and glibc keeps some of a group's freed sums; most at 11 groups of 106M).
BOUND_FIXED_MB = 650.0
# ... at the sizes measured there (17M parameters and up). Below them it is not fixed: measured on
# random Llamas of 78k-17M parameters with vocabularies of 64-49k (session 18,
# `bench_bound_memory.py --small`, bench_bound_small.json) the same part was 45 MiB at 78k, 202 at
# 0.92M, 433-444 from 5M to 17M whatever the vocabulary: about BOUND_FIXED_MB_PER_SQRT_PARAM x the
# square root of the parameter count (an empirical fit, 1.0-1.5x those points), capped at
# BOUND_FIXED_MB. The flat 650 MB had made a zoo model's GRPO estimate 3.8x its measured peak.
BOUND_FIXED_MB_PER_SQRT_PARAM = 0.25


def bound_fixed_bytes(params: int) -> float:
    """The bound check's part beside its sums (BOUND_FIXED_MB, smaller below ~7M parameters)."""
    return min(BOUND_FIXED_MB, BOUND_FIXED_MB_PER_SQRT_PARAM * math.sqrt(max(params, 0))) * MIB


@dataclass(frozen=True)
class BoundPlan:
    """How GRPO's bound check runs beside what the job holds (bound_plan): `groups` of pieces
    (parameter index in the model's order, lo, hi: a flat coordinate range) whose sums fit the
    room one group at a time, or `skip`, why it does not run at all."""

    groups: list[list[tuple[int, int, int]]]
    skip: str | None = None

    @property
    def largest(self) -> int:
        """Coordinates of the largest group."""
        return max((sum(hi - lo for _, lo, hi in g) for g in self.groups), default=0)


BOUND_UNIT = 1 << 20  # compute.studies.bound.SLICE: a parameter is cut into groups at multiples of it


def bound_plan(sizes: list[int], free_bytes: float | None, held_bytes: float = 0.0,
               unit: int = BOUND_UNIT) -> BoundPlan:
    """GRPO's bound check in groups of coordinates (compute.studies.bound.bound_check), one rule for
    the estimate and the job. The room is the memory free on the device beside what the job holds
    then (`held_bytes`: what `free_bytes` does not count yet, the initial Fisher to be made), less
    bound_fixed_bytes and one float32 gradient of the largest parameter (autograd makes it whole
    before the group's part of it is folded). A group holds at most that room at
    BOUND_BYTES_PER_PARAM: consecutive parameters in the model's order, one larger than the room
    cut at multiples of `unit` coordinates. One group of all when it fits, or when free memory is
    unknown. Skipped, with the reason the result gives, only when the room holds not even `unit`
    coordinates; the job is not refused for a diagnostic. `sizes`: each parameter's element count."""
    every = [(i, 0, n) for i, n in enumerate(sizes)]
    if free_bytes is None:
        return BoundPlan([every])
    room = free_bytes - held_bytes - bound_fixed_bytes(sum(sizes)) - 4.0 * max(sizes, default=0)
    cap = int(max(room, 0.0) / BOUND_BYTES_PER_PARAM)  # coordinates per group
    if sum(sizes) <= cap:
        return BoundPlan([every])
    cap -= cap % unit
    if cap < unit:
        need = BOUND_BYTES_PER_PARAM * unit + bound_fixed_bytes(sum(sizes)) + 4.0 * max(sizes, default=0)
        return BoundPlan([], f"not measured: the bound check needs at least {need / 1e9:.3g} GB (its fixed part, "
                             "the largest parameter's gradient and a group of "
                             f"{unit:,} coordinates at {BOUND_BYTES_PER_PARAM:g} bytes each), more than the "
                             f"{max(free_bytes - held_bytes, 0) / 1e9:.3g} GB free beside the job's weights and Fisher")
    groups: list[list[tuple[int, int, int]]] = [[]]
    used = 0
    for i, n in enumerate(sizes):
        lo = 0
        while lo < n:
            if used == cap:
                groups.append([])
                used = 0
            hi = min(n, lo + cap - used)
            if hi < n:
                hi -= hi % unit  # a cut at a multiple of unit; the rest starts the next group
                if hi <= lo:
                    groups.append([])
                    used = 0
                    continue
            groups[-1].append((i, lo, hi))
            used += hi - lo
            lo = hi
    return BoundPlan(groups)


def initial_fisher_device_bytes(params: int, device_is_gpu: bool) -> float:
    """What an initial Fisher still to be made takes of the job's device: the job makes it on the
    host (compute.jobs.train_run.independent_fisher), so nothing on a GPU. The estimate
    (bound_held_bytes, train_memory's "initial Fisher") and the job's own bound plan
    (train_run._bound_plan) all ask this."""
    return 0.0 if device_is_gpu else INITIAL_FISHER_BYTES_PER_PARAM * params


def initial_fisher_host_bytes(params: int, device_is_gpu: bool) -> float:
    """What an initial Fisher takes of the host beside the device's figure: whatever
    initial_fisher_device_bytes does not put on the device (all of it on a GPU; nothing where the
    device is the host, whose figure already counts it)."""
    return INITIAL_FISHER_BYTES_PER_PARAM * params - initial_fisher_device_bytes(params, device_is_gpu)


def bound_held_bytes(z: Sizing, teacher: bool = False, initial_fisher: bool = True) -> float:
    """What a GRPO job holds on its device while its bound check runs: the runtime, the weights
    (a teacher's too), and the initial Fisher where it takes the device (initial_fisher_device_bytes)."""
    return RUNTIME_BASE_MB * MIB + z.params * 4.0 * (2 if teacher else 1) + \
        (initial_fisher_device_bytes(z.params, z.device_is_gpu) if initial_fisher else 0.0)


def bound_plan_of(z: Sizing, teacher: bool = False, initial_fisher: bool = True) -> BoundPlan:
    """bound_plan on a Sizing's estimated parameter sizes (Sizing.tensor_sizes), for the memory
    and the timing estimates; the job plans on its model's own."""
    return bound_plan(z.tensor_sizes(), z.free_bytes, bound_held_bytes(z, teacher, initial_fisher))


def bound_check_runs(z: Sizing, teacher: bool = False, initial_fisher: bool = True) -> bool:
    """Whether a GRPO job's bound check will run (bound_plan) beside what the job holds then."""
    return bound_plan_of(z, teacher, initial_fisher).skip is None


# A tensor-file job (mask, diff, series): each tensor file element read, held and compared
FILE_BYTES_PER_ELEMENT = 12.0
# What a training step's forward+backward holds, as a share of Sizing.activation_bytes with one
# chunk of logits (LOGITS_CHUNK_BYTES), gradient checkpointing on or off. Fitted on 8 measurements
# (benchmarks/bench_logits.py --checkpointing, 20m Llama shape, 8 rows x 64-1,024 tokens, CPU;
# bench_logits.json): activations measured 0.83-1.0x the formula; with this share and the dense
# gradients the predicted peak is 0.91-1.19x the measured one in every case. It was 0.1 until
# session 13, fitted where the runtime base hid the activations: 7x low for a long sequence.
TRAIN_ACTIVATION_SHARE = 0.9
# The Fisher engine lets rows into a chunk up to this share of its temporaries budget by that
# formula: the rest is for the per-weight square sums, the hooks' output gradients and the
# allocator's freed blocks. Measured (benchmarks/pass_peaks.py) on a 100M Llama at the default workload (64 x 4 x 16, 1 GiB,
# L = 22): a chunk of the whole budget held 1.10x it above the accumulators in the job (1126 MiB),
# 0.74x in a pass alone (glibc keeps one pass's freed blocks while the next maps anew).
ROW_BUDGET_SHARE = 0.75
# What a chunk of rows holds in a Fisher job, as a share of that formula: 1.1 measured in the job
# (100M Llama: 1126 MiB for a 1020 MiB chunk; SmolLM2-135M at its default workload: about 1.4 GiB
# for 26 rows of 51.6 MB), the pass itself about 0.74 and the allocator's kept blocks the rest
FISHER_HELD_SHARE = 1.1
# compute/fisher estimate_fisher: the token estimator's prompts go through the engine in at most
# this many chunks (fisher_chunks), so its expanded rows (one per counted token) stay bounded
PROMPT_CHUNKS = 10


def fisher_chunks(estimator: str, prompts: int, engine_rows: int, rows_per_forward: int) -> int:
    """How many chunks of prompts estimate_fisher hands the engine (the cost model reads the same).

    sequence / empirical: one call, rows sorted by length (progress after each forward). token: its
    rows expanded one per counted token a chunk at a time, at most PROMPT_CHUNKS chunks and never
    more than its forwards, so every chunk fills a forward. A pass has a cost per parameter (the
    sums' update, a rounding of the compact difference) whatever its rows: issue 30 found 4 passes of
    2 rows where 1 of 8 served, the job 4.9x its floor at 4 x 2 x 8 on a 100M model."""
    if estimator != "token":
        return 1
    forwards = -(-max(1, engine_rows) // max(1, rows_per_forward))
    return max(1, min(prompts, PROMPT_CHUNKS, forwards))


# How long sampled completions run. A batch of completions decodes until every row has ended (its
# end-of-sequence token) or reached max_new_tokens; the estimate had priced every batch at
# max_new_tokens, an upper bound about 2x the clock of a GRPO job on a model that answers in a few
# tokens (benchmarks/results/bench_estimate_parts.json, "stops"). The jobs that sample record
# their completions' lengths (summary["completion_lengths"], length_record); a later estimate on
# the same model, task and temperature reads them (app.limits.stop_history) and prices each batch
# at its expected length, expected_batch_steps: the Kaplan-Meier survival of a completion's length
# (a row that reached its job's limit without ending is censored there, so a longer limit than any
# recorded is priced as running on), and a batch ends with the longest of its rows.


def length_record(lengths: list[tuple[int, bool]], max_new_tokens: int) -> dict[str, object]:
    """{"max_new_tokens", "rows", "stopped": {length: rows that ended there}, "open": rows that
    reached max_new_tokens without ending} of sampled completions [(tokens generated, ended)]."""
    stopped: dict[str, int] = {}
    open_ = 0
    for n, ended in lengths:
        if ended:
            stopped[str(int(n))] = stopped.get(str(int(n)), 0) + 1
        else:
            open_ += 1
    return {"max_new_tokens": int(max_new_tokens), "rows": len(lengths),
            "stopped": dict(sorted(stopped.items(), key=lambda kv: int(kv[0]))), "open": open_}


def merge_length_records(records: list[dict]) -> dict | None:
    """One record of several with the same max_new_tokens (a job's shards, its steps); None when
    there are none. Records of different limits cannot merge: ValueError."""
    if not records:
        return None
    limits = {int(r["max_new_tokens"]) for r in records}
    if len(limits) != 1:
        raise ValueError(f"completion_lengths: records of different max_new_tokens {sorted(limits)}")
    stopped: dict[str, int] = {}
    for r in records:
        for k, v in r["stopped"].items():
            stopped[k] = stopped.get(k, 0) + int(v)
    return {"max_new_tokens": limits.pop(), "rows": sum(int(r["rows"]) for r in records),
            "stopped": dict(sorted(stopped.items(), key=lambda kv: int(kv[0]))),
            "open": sum(int(r["open"]) for r in records)}


def length_survival(records: list[dict], upto: int) -> list[float]:
    """S(l) = P(a completion runs more than l tokens) for l = 0..upto-1, the Kaplan-Meier estimate
    over every record's rows: a row that ended at length L is an event at L, one that reached its
    record's max_new_tokens M without ending is censored at M (at risk up to M). Past the last
    length any row was at risk, S stays where it was: rows not seen to end are priced as running on."""
    events: dict[int, int] = {}
    at_least: dict[int, int] = {}  # rows observed to run at least L tokens, by the L they leave at
    for r in records:
        for k, v in r["stopped"].items():
            events[int(k)] = events.get(int(k), 0) + int(v)
            at_least[int(k)] = at_least.get(int(k), 0) + int(v)
        if int(r["open"]):
            m = int(r["max_new_tokens"])
            at_least[m] = at_least.get(m, 0) + int(r["open"])
    risk = sum(at_least.values())  # every row runs at least 1 token
    out, s = [], 1.0
    for length in range(0, upto):
        out.append(s)
        nxt = length + 1  # the rows at risk of ending at length+1 are those that ran past `length`
        if risk > 0 and events.get(nxt):
            s *= 1.0 - events[nxt] / risk
        risk -= at_least.get(nxt, 0)
    return out


def expected_batch_steps(records: list[dict] | None, batch: int, max_new_tokens: int) -> float:
    """Expected decode steps of one batch of `batch` sampled rows capped at max_new_tokens: the
    batch runs while any row runs, E[min(m, max_i L_i)] = sum_{l<m} 1 - (1 - S(l))^batch with the
    rows independent draws of length_survival. max_new_tokens when nothing is recorded."""
    if not records or batch < 1:
        return float(max_new_tokens)
    return float(sum(1.0 - (1.0 - s) ** batch for s in length_survival(records, max_new_tokens)))


@dataclass(frozen=True)
class Sizing:
    """What a kind's timing and memory read: the (largest) model's size and shape, the files it
    reads, and this machine (calibration a, b of seconds = token_passes x (a + b x params); the
    device's free memory, for a Fisher's default temporaries budget)."""

    params: int
    layers: int = 2
    hidden: int = 64
    vocab: int = 100
    data_elements: int = 0
    a: float = 0.0
    b: float = 0.0
    intermediate: int = 0
    free_bytes: float | None = None
    models: int = 1  # how many models the job holds at once (OPD's teacher, a diff's pair)
    # tokens of one prompt: the task's (compute.contract.tasknames.prompt_tokens: an arithmetic
    # prompt is about 7, a jsonl file counts as COST_PROMPT_TOKENS)
    prompt_tokens: int = COST_PROMPT_TOKENS
    shared: int = 0  # elements of parameters used twice (a tied embedding)
    mask_density: float | None = None  # a given mask file's density, from its header (None: unknown)
    # free_bytes is a GPU's: what the job keeps on the host (the initial Fisher) is not in it
    device_is_gpu: bool = False
    # the input and output embeddings are one matrix (the config says so): the Fisher job skips
    # its exact output-layer check, whose time the estimate then leaves out
    tied: bool = False
    # sampled completions' recorded lengths on this model and task, by temperature (length_record
    # dicts, app.limits.stop_history): what generate_s prices a sampled batch's steps by
    stops: Mapping[float, list[dict]] | None = None

    def passes_s(self, token_passes: float) -> float:
        """Seconds of `token_passes` of forward/backward at the calibration."""
        return max(token_passes, 0.0) * (self.a + self.b * self.params)

    def calls_s(self, calls: float) -> float:
        """Seconds of `calls` calls' fixed parts (CALL_TOKEN_PASSES x a each)."""
        return max(calls, 0.0) * CALL_TOKEN_PASSES * self.a

    def load_s(self) -> float:
        return self.calls_s(MODEL_LOAD_CALLS) + self.models * self.params * 4 / LOAD_BYTES_PER_S

    def reload_s(self) -> float:
        """A model loaded again in a process that has loaded it (a sweep's next point)."""
        return self.calls_s(MODEL_RELOAD_CALLS) + self.models * self.params * 4 / LOAD_BYTES_PER_S

    def decode_step_calls(self) -> float:
        return DECODE_STEP_CALLS_PER_LAYER * max(self.layers, 1)

    def generate_s(self, seqs: int, new_tokens: int, batch: int, prompt: int | None = None,
                   temperature: float | None = None) -> float:
        """Sampling `seqs` completions of at most `new_tokens` in batches of `batch`: the token-passes
        of the prompt and of every decode step over the whole batch (a row that has ended is still
        carried), plus a decode step's fixed part per step (one step after another). A batch runs
        expected_batch_steps on the lengths recorded at this temperature (`stops`), else to
        new_tokens (greedy decoding, temperature None, always to new_tokens: an upper bound)."""
        prompt = self.prompt_tokens if prompt is None else prompt
        seqs, batch = max(seqs, 0), max(batch, 1)
        sizes = [batch] * (seqs // batch) + ([seqs % batch] if seqs % batch else [])
        steps = {b: self.batch_steps(b, new_tokens, temperature) for b in set(sizes)}
        return (self.passes_s(sum(b * (prompt + steps[b]) for b in sizes))
                + self.calls_s(sum(steps[b] for b in sizes) * self.decode_step_calls()))

    def batch_steps(self, batch: int, new_tokens: int, temperature: float | None) -> float:
        """Expected decode steps of one sampled batch of `batch` rows (new_tokens without recorded
        lengths at this temperature, or for greedy decoding, None); batch 1: a row's expected
        length, the tokens it counts."""
        records = (self.stops or {}).get(float(temperature)) if temperature is not None else None
        return expected_batch_steps(records, batch, new_tokens)

    def weight_bytes(self, dtype_bytes: float = 4.0) -> float:
        return self.models * self.params * dtype_bytes

    def tensor_sizes(self) -> list[int]:
        """Element counts of the model's parameters in a decoder's order, estimated from the shape:
        the embedding, per layer the attention's parameters (what the count leaves beside the
        embedding, the MLPs and an untied head, in four equal parts: grouped-query k, v are
        smaller than q, o) and three hidden x intermediate MLP matrices, then an untied head when
        the count holds a second embedding-sized matrix beside at least hidden^2 of attention a
        layer. A shape the count cannot hold: even parts. What bound_plan groups for an estimate."""
        inter = self.intermediate or 4 * self.hidden
        emb, mlp = self.vocab * self.hidden, self.hidden * inter
        rest = self.params - emb - 3 * mlp * self.layers
        head = emb if rest >= emb + self.layers * self.hidden ** 2 else 0
        rest -= head
        if rest < 0 or self.layers < 1:
            k = max(1, self.layers * 7 + 1)
            return [self.params // k] * (k - 1) + [self.params - (k - 1) * (self.params // k)]
        attn = rest // (4 * self.layers)
        out = [emb + rest - 4 * attn * self.layers]
        for _ in range(self.layers):
            out += [attn] * 4 + [mlp] * 3
        return out + ([head] if head else [])

    def matrices(self) -> list[tuple[int, int]]:
        """A decoder's 2-D weights (rows, cols) from the shape: per layer q, k, v, o (taken as
        hidden x hidden: grouped-query k, v are smaller) and three hidden x intermediate MLP
        matrices, and the embedding (a second one when the head is untied)."""
        inter = self.intermediate or 4 * self.hidden
        per_layer = [(self.hidden, self.hidden)] * 4 + [(self.hidden, inter)] * 3
        return [(self.vocab, self.hidden)] * (1 if self.tied else 2) + per_layer * max(self.layers, 0)

    def svd_s(self, max_numel: int) -> float:
        """Seconds of the singular values of every 2-D weight-sized delta of at most `max_numel`
        elements (the diff's spectra): a fixed part each and their multiply-adds."""
        shapes = [(m, n) for m, n in self.matrices() if m * n <= max_numel]
        work = sum(min(m, n) ** 2 * max(m, n) for m, n in shapes)
        return self.calls_s(DIFF_CALLS_PER_MATRIX * len(shapes)) + DIFF_SVD_PASSES * self.b * work

    def largest_tensor(self) -> int:
        """Elements of the model's largest weight (the embedding, or an MLP matrix)."""
        inter = self.intermediate or 4 * self.hidden
        return min(self.params, max(self.vocab * self.hidden, inter * self.hidden))

    def activation_bytes(self, tokens: int, logit_tokens: int | None = None, checkpointed: bool = False) -> float:
        """Saved activations of a forward+backward over `tokens` tokens, with their float32 logits:
        without `logit_tokens`, the whole logits four times over (logits, log_softmax, their
        gradients: compute/fisher/estimators.py sizes its row chunks with this formula); with it,
        one chunk of that many tokens twice over (training's head a chunk at a time,
        compute.lm.head: the chunk's logits and the one gradient built in place).
        checkpointed (gradient checkpointing): each layer's input, and one layer's activations
        at a time in backward."""
        inter = self.intermediate or 4 * self.hidden
        per_layer = 4.0 * tokens * (12 * self.hidden + 4 * inter)
        layers = 4.0 * tokens * self.hidden * self.layers + per_layer if checkpointed else per_layer * self.layers
        if logit_tokens is None:
            return layers + 16.0 * tokens * self.vocab
        return layers + 8.0 * min(tokens, logit_tokens) * self.vocab

    def kv_cache_bytes(self, rows: int, length: int) -> float:
        """Generation's KV cache and logits of `rows` rows of `length` tokens (fp32)."""
        return 4.0 * rows * (length * self.layers * 2 * self.hidden + 2 * self.vocab)


# The automatic temporaries budget of every per-sample engine (Fisher, tokens, the precision check):
# this share of the memory a job may use, within these bounds (MiB). One rule for the job
# (compute.lm.device.default_budget_mb) and the estimate before it (fisher_budget_bytes): the
# estimate took a quarter without the bounds (issue 30's "one rule, every kind": 50 GB where
# the job takes 32 GiB on a 200 GB host; 150 MB where it takes 256 MiB on a small one).
BUDGET_SHARE = 0.25
BUDGET_MIN_MB, BUDGET_MAX_MB = 256, 32768


def default_budget_mb(free_bytes: float | None) -> int:
    """The automatic budget (MiB) where a job may use `free_bytes` (unknown: 4 GiB)."""
    mb = int((free_bytes if free_bytes is not None else 4 * 2**30) * BUDGET_SHARE) // 2**20
    return max(BUDGET_MIN_MB, min(BUDGET_MAX_MB, mb))


def fisher_budget_bytes(memory_budget_mb: int | None, free_bytes: float | None) -> float:
    """The per-sample temporaries budget a Fisher uses: the spec's, else default_budget_mb of
    the memory a job may use (what the engine takes by default, compute.lm.device)."""
    if memory_budget_mb is not None:
        return memory_budget_mb * MIB
    return default_budget_mb(free_bytes) * MIB


def job_room_bytes(free_now: float, cap_mb: float | None, in_use: float) -> float:
    """What a running job may still take on its device: what is free there now, and, where the
    operator caps a job's memory (MAX_JOB_MEMORY_MB, checked at submit against the estimated
    peak), no more than the cap less what the job's process holds there already. The estimate
    reads the cap as the job's whole allowance (app.limits.free_memory) and counts the runtime
    and weights against it; the running job has them resident, so it subtracts what it holds."""
    return free_now if cap_mb is None else max(0.0, min(free_now, cap_mb * MIB - in_use))


# ---------------------------------------------------------------- the kinds' shared phases


def fisher_seconds(z: Sizing, prompts: int, samples: int, max_new_tokens: int,
                   estimator: str = "sequence", exact_output: bool = False,
                   sample_batch: int = 64, statistics: bool = True,
                   temperature: float = 1.0) -> dict[str, float]:
    """A Fisher estimate's phases, by the names the job reports its own (fisher_run:
    `summary.seconds_parts`): sampling, the engine's self-check (a few rows' per-row gradients
    against autograd's, compared over every parameter), the per-row gradients, the exact
    output-layer check, the statistics over every parameter."""
    rows = prompts * samples
    # a row's tokens as sampled (its batch's expected length where lengths are recorded: the
    # passes run over the padded rows, no longer than their batch)
    new = z.batch_steps(min(rows, sample_batch), max_new_tokens, temperature)
    length = z.prompt_tokens + new
    # the token estimator: a row per counted token, a completion's own length (not its batch's)
    per_row = z.batch_steps(1, max_new_tokens, temperature) if estimator == "token" else 1
    out = {"sampling": 0.0 if estimator == "empirical" else
           z.generate_s(rows, max_new_tokens, sample_batch, temperature=temperature)}
    if estimator != "batch":  # the per-sample engine checks itself once (estimators._verify)
        out["self-check"] = (z.calls_s(CHECK_CALLS + CHECK_CALLS_PER_PARAM * z.params)
                             + z.passes_s(min(rows, CHECK_ROWS) * length * 4))
    out["per-sample passes"] = (z.calls_s(rows * FISHER_ROW_CALLS)
                                + FISHER_ROW_PASS_FACTOR * z.passes_s(rows * length * 3 * per_row))
    if exact_output:
        out["exact output check"] = z.calls_s(rows * EXACT_ROW_CALLS) + z.passes_s(rows * length)
    if statistics:
        out["statistics"] = z.calls_s(STATS_CALLS_PER_PARAM * z.params)
    return out


def train_seconds(z: Sizing, algo: str, steps: int, batch: int, group: int, max_new_tokens: int,
                  eval_prompts: int, eval_new_tokens: int = 8, checkpointing: bool = False,
                  temperature: float = 1.0, sft_source: str = "gold") -> dict[str, float]:
    """One training run's phases: greedy accuracy before and after, and per step the sampling
    (GRPO, OPD, and SFT on near-policy data, which samples `group` completions a prompt and keeps
    the rewarded ones; SFT on gold answers samples nothing), the teacher (OPD) and one gradient
    step over every sequence (a forward more with gradient checkpointing)."""
    sampled = algo != "sft" or sft_source != "gold"
    rows = batch * (group if sampled else 1)
    length = z.prompt_tokens + (z.batch_steps(rows, max_new_tokens, temperature) if sampled else max_new_tokens)
    sample = z.generate_s(rows, max_new_tokens, rows, temperature=temperature) if sampled else 0.0
    teacher = z.passes_s(rows * length) if algo == "opd" else 0.0
    step = sample + teacher + z.calls_s(TRAIN_STEP_CALLS) + z.passes_s(rows * length * (4 if checkpointing else 3))
    evals = 2 * z.generate_s(eval_prompts, eval_new_tokens, 256)
    return {"steps": steps * step, "evaluation": evals}


def bound_seconds(z: Sizing, rows: int, max_new_tokens: int, groups: int = 1,
                  temperature: float = 1.0) -> float:
    """GRPO's bound check: its batch sampled, a per-sample gradient of every row of the first
    batch once per group of coordinates (bound_plan; a group after the first counted as
    BOUND_GROUP_BACKWARD_SHARE of a whole backward: it stops below its earliest parameter), each
    row's gradient folded into the sums once per coordinate, and the summary's pass over the
    coordinates."""
    length = z.prompt_tokens + z.batch_steps(rows, max_new_tokens, temperature)
    backward = z.calls_s(rows * BOUND_ROW_CALLS_PER_LAYER * max(z.layers, 1)) + z.passes_s(rows * length * 3)
    repeats = 1 + BOUND_GROUP_BACKWARD_SHARE * (max(1, groups) - 1)
    summary_end = BOUND_SUMMARY_CALLS * min(1.0, z.params / BOUND_CORR_COORDS)
    return z.generate_s(rows, max_new_tokens, rows, temperature=temperature) + repeats * backward + \
        z.calls_s(summary_end + z.params * (rows * BOUND_FOLD_CALLS_PER_PARAM_ROW + BOUND_SUMMARY_CALLS_PER_PARAM))


def train_finish_seconds(z: Sizing) -> float:
    return z.calls_s(TRAIN_FINISH_CALLS + TRAIN_FINISH_CALLS_PER_PARAM * z.params)


def fisher_temporaries(z: Sizing, rows: int, length: int, budget: float) -> float:
    """The per-sample engine's temporaries for one call over `rows` rows (estimate_fisher hands it
    a chunk of the prompts at a time: fisher_memory). The engine lets rows into a forward up to
    ROW_BUDGET_SHARE of the budget by its per-row formula (activations + a per-row gradient
    buffer of each shared parameter: compute/fisher/estimators.py _auto_batch); a chunk of rows
    holds FISHER_HELD_SHARE of that formula in the job, never more than the budget."""
    per_row = z.activation_bytes(length) + 4.0 * z.shared
    chunk_rows = min(rows, rows_per_forward(z, length, budget))
    return min(budget, FISHER_HELD_SHARE * chunk_rows * per_row)


# config.json keys of each Sizing shape field, first found wins (HF names, then GPT-2's)
SHAPE_KEYS = (("layers", ("num_hidden_layers", "n_layer")), ("hidden", ("hidden_size", "n_embd")),
              ("vocab", ("vocab_size",)), ("intermediate", ("intermediate_size", "n_inner")))


def config_shape(cfg: object) -> dict[str, int]:
    """{"layers", "hidden", "vocab", "intermediate"}: what a model config (a config.json dict or
    a transformers config object; a multimodal model's text_config) says of each, the keys it
    lacks left out. The web process (app/limits.py, from the file) and the engine (from the
    loaded model) read a shape through this one function, so both size rows alike."""
    def get(obj: object, key: str) -> object:
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    text = get(cfg, "text_config")
    cfg = text if text is not None else cfg
    out: dict[str, int] = {}
    for field, names in SHAPE_KEYS:
        for n in names:
            v = get(cfg, n)
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                out[field] = int(v)
                break
    return out


# the engine's guess for a shape its model's config lacks: a larger guess only sizes batches smaller
ENGINE_SHAPE_GUESS = {"layers": 4, "hidden": 256, "vocab": 32000}


def rows_per_forward(z: Sizing, length: int, budget: float) -> int:
    """Rows per forward at row length `length`: ROW_BUDGET_SHARE of the budget over the per-row
    formula (activations, Sizing.activation_bytes, + a per-row gradient buffer of each shared
    parameter). The engine's automatic batch is this function (compute/fisher/estimators.py
    _auto_batch builds a Sizing from its model's config), so the estimate and the job agree."""
    per_row = z.activation_bytes(length) + 4.0 * z.shared
    return max(1, int(budget * ROW_BUDGET_SHARE // max(per_row, 1.0)))


def fisher_memory(z: Sizing, prompts: int, samples: int, max_new_tokens: int,
                  memory_budget_mb: int | None, dtype_bytes: float = 4.0,
                  sample_batch: int = 64, estimator: str = "sequence") -> dict[str, float]:
    """A Fisher job's peak: the weights in their dtype, the accumulators, the per-row temporaries
    (at most the budget: the rows of one chunk at the job's row length) and sampling's cache.
    `token` hands the engine one row per counted token (expand_tokens): up to max_new_tokens rows
    per sampled row, counted at the full row length (an upper bound: they are truncated)."""
    rows = prompts * samples
    length = z.prompt_tokens + max_new_tokens
    budget = fisher_budget_bytes(memory_budget_mb, z.free_bytes)
    per_row_of = max(1, max_new_tokens) if estimator == "token" else 1  # expanded rows per row
    chunks = fisher_chunks(estimator, prompts, rows * per_row_of, rows_per_forward(z, length, budget))
    per_call = -(-prompts // chunks) * samples * per_row_of  # compute.fisher._half_sums
    return {
        "runtime": RUNTIME_BASE_MB * MIB,
        "weights": z.weight_bytes(dtype_bytes),
        "accumulators": FISHER_BYTES_PER_PARAM * z.params,
        "temporaries": fisher_temporaries(z, per_call, length, budget),
        "sampling cache": z.kv_cache_bytes(min(rows, sample_batch), length),
    }


def train_memory(z: Sizing, algo: str, batch: int, group: int, max_new_tokens: int,
                 optimizer: str, mask_fraction: float = 1.0, concentration: bool = True,
                 teacher: bool = False, initial_fisher: bool = True, checkpointing: bool = False,
                 bound: bool = False) -> dict[str, float]:
    """One training run's peak on its device, every part summed: weights (a teacher's too), the
    gradients (every one in a dense run; in a masked one, mask_fraction < 1, a block of the largest
    tensor's rows and the folded trained coordinates), the initial Fisher where it takes the device
    (initial_fisher_device_bytes: nothing on a GPU, train_host_memory names it there), the
    optimizer's state for the trained coordinates, and the activations of one step's rows at their
    length; `bound` (GRPO's bound check before the first step) what its phase holds (the float64
    sums of its largest group of coordinates, bound_plan, and its fixed part) beyond the steps'
    phase, when it runs at all (else the job skips it and says so)."""
    rows = batch * (1 if algo == "sft" else group)
    length = z.prompt_tokens + max_new_tokens
    state = OPTIMIZER_BYTES_PER_TRAINED_COORD.get(optimizer, 8.0) * mask_fraction
    conc = CONCENTRATION_BYTES_PER_PARAM if concentration else 0.0
    parts = {"runtime": RUNTIME_BASE_MB * MIB, "weights": z.params * 4.0 * (2 if teacher else 1)}
    # The job makes and keeps its initial Fisher on the host (train_run._initial_fisher: a given
    # file read there, an estimate's sums handed over .cpu()): a GPU's peak does not hold it, only a
    # CPU's, where the device is the host (issue 30; before, 4 bytes/param too many on a GPU, 32.8 GB
    # at 8B, refusing jobs that fit). One rule with the bound plan: initial_fisher_device_bytes.
    fisher = initial_fisher_device_bytes(z.params, z.device_is_gpu)
    if mask_fraction < 1.0:
        trained = mask_fraction * z.params
        parts["gradients (a block of rows at a time) and mask"] = min(4.0 * z.largest_tensor(), FOLD_BLOCK_BYTES) + \
            (MASKED_BYTES_PER_TRAINED_COORD + conc) * trained
        parts["initial Fisher"] = fisher if initial_fisher else 0.0
    else:
        parts["gradients, step temporaries"] = (TRAIN_BYTES_PER_PARAM + conc) * z.params
        # the dense constant was fitted with the Fisher in it (TRAIN_BYTES_PER_PARAM): counted
        # whether or not the run needs one, as before, so a CPU's dense figures are unchanged
        parts["initial Fisher"] = fisher
    parts |= {"optimizer state": state * z.params,
              "activations": TRAIN_ACTIVATION_SHARE * z.activation_bytes(
                  rows * length, logit_tokens=None if teacher else logits_chunk_tokens(z.vocab),
                  checkpointed=checkpointing)}
    plan = bound_plan_of(z, teacher, initial_fisher) if bound else None
    if plan is not None and plan.skip is None:  # a check that does not fit at all is skipped
        check = BOUND_BYTES_PER_PARAM * plan.largest + bound_fixed_bytes(sum(z.tensor_sizes())) + \
            (4.0 * max(z.tensor_sizes()) if len(plan.groups) > 1 else 0.0)
        # the check runs before the steps, beside the weights and the initial Fisher, and frees
        # its sums: the peak holds the larger of the two phases
        steps = sum(v for k, v in parts.items() if k not in ("runtime", "weights", "initial Fisher"))
        parts[BOUND_PART] = max(0.0, check - steps)
    return parts


def train_host_memory(z: Sizing, initial_fisher: bool = True) -> dict[str, float]:
    """What a training run holds in host memory beside its device peak (train_memory), where the
    device is a GPU (Sizing.device_is_gpu): the initial Fisher, when the run needs one
    (initial_fisher_host_bytes). Shown with the estimate, never summed into the device's peak nor
    compared with the device's free memory (no host figure is read on a GPU worker); {} on a CPU,
    whose peak counts it."""
    host = initial_fisher_host_bytes(z.params, z.device_is_gpu) if initial_fisher else 0.0
    return {"initial Fisher": host} if host > 0 else {}


# train_memory's part for GRPO's bound check: what its phase holds beyond the steps' phase
BOUND_PART = "GRPO bound check (its largest group's float64 sums, beyond what the steps hold)"


def logits_chunk_tokens(vocab: int, chunk_bytes: int | None = None) -> int:
    """Tokens per chunk of the training objectives' head (compute.lm.head reads this): float32
    logits of at most `chunk_bytes` (LOGITS_CHUNK_BYTES), >= 1. On-policy distillation (a
    teacher) reads the whole logits (its full-vocabulary KL) and is counted with them."""
    return max(1, (chunk_bytes or LOGITS_CHUNK_BYTES) // (4 * max(1, vocab)))


def file_memory(z: Sizing, models: int = 0) -> dict[str, float]:
    """A job over tensor files (and `models` models' weights read tensor by tensor)."""
    return {
        "runtime": (RUNTIME_BASE_MB if models else FILE_JOB_BASE_MB) * MIB,
        "tensors": FILE_BYTES_PER_ELEMENT * max(z.data_elements, z.params * models),
    }
