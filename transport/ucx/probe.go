package ucx

// Report is what Probe finds out about UCX on this machine: what
// `cudaipc doctor` shows.
type Report struct {
	// Library is the libucp that was loaded, or that failed to load.
	Library string
	// Version is UCX's version, e.g. "1.13.1"; empty when Err is set.
	Version string
	// Resources are the transports and devices UCX finds under the current
	// UCX_TLS and UCX_NET_DEVICES.
	Resources []Resource
	// MemoryTypes are the kinds of memory UCX can register.
	MemoryTypes []MemoryType
	// Err says why UCX cannot be used (errors.Is(Err, ErrNotFound) when it
	// is not installed), or is nil.
	Err error
}

// CanRegisterCUDA reports whether UCX can register GPU memory directly
// (UCX built with CUDA support, a driver present); otherwise GPU data
// crosses nodes through host staging.
func (r Report) CanRegisterCUDA() bool {
	for _, t := range r.MemoryTypes {
		if t == MemoryCUDA {
			return true
		}
	}
	return false
}

// Probe loads UCX, makes a Context to see its transports and memory types,
// and closes it.
func Probe() Report {
	r := Report{Library: Library()}
	if r.Err = Available(); r.Err != nil {
		return r
	}
	if r.Version, r.Err = Version(); r.Err != nil {
		return r
	}
	c, err := NewContext(ContextOptions{Name: "cudaipc-probe"})
	if err != nil {
		r.Err = err
		return r
	}
	defer c.Close()
	r.MemoryTypes = c.MemoryTypes()
	r.Resources, r.Err = c.Resources()
	return r
}
