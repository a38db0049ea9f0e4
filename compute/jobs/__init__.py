"""Job kinds: one module per kind, each declaring everything the kind is (`KIND = JobKind(...)`).

compute/jobs/registry.py discovers them (`KINDS`, `get(kind)`, `parse_spec`, `parse_result`,
`check`); the API, CLI, UI, share page, limits, runners and the worker iterate that registry, and
no other list of kinds exists (tests/unit/test_registry.py checks).

How to add a kind `foo`
-----------------------
1. compute/jobs/foo.py (pure: pydantic and compute.contract only; the web process imports it):
   - `class FooSpec(Spec)`: its fields, with bounds and a `description` each (the CLI options,
     the API schema and the UI form are generated from them). Shared field types (ModelRef,
     TaskRef, Seed, Steps, ...) are in compute/contract/specs.py.
   - its result: `class FooSummary(Summary)` (typed headline numbers), `class FooResult(
     TypedResult[FooSummary])` with `kind: Literal["foo"]`, and `CONTRACT = Contract("foo",
     FooResult, heatmaps=..., series=..., groups=...)`: the exact names it stores.
   - `def cost(spec) -> int`: its token-passes (compute/contract/cost.py has the shared
     formulas); required.
   - `KIND = JobKind(name="foo", title=..., spec=FooSpec, contract=CONTRACT,
     runner="compute.some_module:run", cost=cost, order=..., refs={field: target},
     outputs={target: artifact kind}, form=KindForm(...) or None, cli_args=(...))`.
   The runner (`run(spec, progress) -> JobResult`, optionally children / run_child / combine in
   the same module: compute/jobs/runners.py) is imported lazily, by the worker and the CLI only: it
   may be a compute module of its own, or a function in compute/jobs/foo.py itself as long as it
   imports torch and the engine inside the function (this module is imported by the web process).
2. app/figures/foo.py: its figures (`@figure("foo", ...)`, `stored_heatmap`), tables (`@table`)
   and key numbers (`@key_numbers("foo")`), from the typed result (app/figures/registry.py).

Nothing else: the registry gives it a `fisherlens foo` command (options from the spec, result
written to --out), a place in the API's kind enum and in `POST /api/jobs`, a New job sub-tab when
`form` is set, a share-page title, a cost, and the worker runs it. A missing part (no cost, a form
naming an unknown field, a figures module missing) fails tests/unit/test_registry.py.
"""
