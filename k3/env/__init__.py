"""Agent environments (report §4.2, §5.3.2): sandboxes, a white-box agent harness, and verifiable tasks.

Layers, each importing only those before it: `sandbox` (and `bwrap`) <- `task` <- `tools` <- `harness`
<- `episode` <- `tasks/` (the task families) <- `run` (`k3 env run`). Nothing here imports the model or the
server: an environment talks to a policy through an OpenAI-compatible chat endpoint (`client`), so it evaluates
k3's models and any other.
"""
