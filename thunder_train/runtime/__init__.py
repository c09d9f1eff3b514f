"""Call time: what runs when a compiled function is called (dispatch, cache, thin binding, slots); docs/architecture.md."""
