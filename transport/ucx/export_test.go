package ucx

// LeakedContexts is how many Contexts the cleanup backstop released.
func LeakedContexts() int64 { return leakedContexts.Load() }
