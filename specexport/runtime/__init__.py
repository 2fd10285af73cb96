"""The runtime: numpy + ONNX Runtime, no torch.

Shape legend used in comments throughout: B batch, T tokens in one call (prefill chunk, 1, or tree
size), S sequence, V vocab, H hidden, L layers, Hkv KV heads, D head dim, γ (gamma) draft length.

Glossary (vLLM's words): a *proposal* is the draft's tokens for one round; the target's *verdict*
lists the *accepted* draft tokens, then one more token: the *bonus* token (sampled from the target
after every proposal was accepted) or the *recovered* token (sampled from the residual after a
rejection). A *path* is the accepted chain of tree *nodes*, root first.
"""
