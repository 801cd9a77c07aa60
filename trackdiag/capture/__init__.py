"""How trackdiag sees the user's loop: the components (model, optimizer), the gradient tap, the forward
watch, optimizer step hooks, the layer index, the user's loss function. Probes read what this leaves.
"""
