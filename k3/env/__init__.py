"""Agent environments (report §4.2, §5.3.2): sandboxes, a white-box agent harness, and verifiable tasks.

Layers, each importing only those before it:
- `call`: one tool call's limits, process tree and result.
- `sandbox` (and `bwrap`): where tool calls run; fork, snapshot, restore.
- `task`: a problem instance, its verifiers and budget; `tasks/` holds the families.
- `tools`, `toolbox`: what an agent can do, each tool's JSON schema declared once; `memory`, `skills`.
- `harness`, `presets`, `context`: a harness is a composition of those modules (plain data, a JSON file or a
  preset); the sampler draws compositions per task group.
- `client`: the policy, any OpenAI-compatible chat endpoint (or a script).
- `episode`, `trajectory`: one task with one harness and one policy, start to verdict, saved as a JSONL record.
- `run`, `cli`: `k3 env run`, many episodes concurrently with a summary table.

Nothing here imports the model or the serving engine (only `cli` does, to serve a checkpoint in-process for
`--ckpt`): an environment talks to a policy through an OpenAI-compatible endpoint, so it evaluates k3's models
and any other.
"""
