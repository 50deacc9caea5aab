package cluster

import "context"

// Transport is the data plane seam: one-sided reads of memory that another
// node exposed (its UCX worker address, an rkey and a remote address, from
// an Exposure). The UCX implementation registers arenas once, when they
// are made, and reads with ucp_get_nbx; tests use an in-process one that
// moves real bytes.
type Transport interface {
	// WorkerAddress is this node's worker address, which peers connect
	// to.
	WorkerAddress() []byte
	// Connect returns an endpoint to the worker at addr. A malformed
	// address is an error, never a crash.
	Connect(ctx context.Context, addr []byte) (Endpoint, error)
}

// Endpoint reads from one remote worker.
type Endpoint interface {
	// Get reads len(dst) bytes at remote address addr of the memory that
	// rkey (packed by the remote side) describes into dst, returning when
	// the bytes are in dst or ctx is done. A malformed rkey is an error.
	Get(ctx context.Context, rkey []byte, addr uint64, dst []byte) error
	// Close closes the endpoint.
	Close() error
}
