// Package ucx is the data plane between cudaipc nodes: one-sided reads of a
// peer's registered memory over UCX UCP (libucp.so.0, loaded at run time by
// internal/ucx; the module still builds with CGO_ENABLED=0 and a machine
// without UCX gets errors matching ErrNotFound).
//
// # Objects and lifetimes
//
// A Context (ucp_context_h) holds Workers and MemRegions; a Worker holds
// Endpoints; an Endpoint holds RemoteKeys. Every object has an idempotent
// Close, and closing a parent closes what is still open under it
// (Context.Close closes everything). After Close, methods return ErrClosed.
// Endpoint.Close keeps the UCX endpoint of a live peer for the worker's
// next Connect to the same address (its comment says why).
// A Context that becomes unreachable without Close, with everything made
// on it, is released by a runtime cleanup that logs a warning: a backstop,
// not a way to close.
//
//   - The serving side registers each arena once (Context.Register: one
//     ucp_mem_map and one packed rkey per arena, never per object), publishes
//     its Worker.Address and the region's Key (both have binary encodings),
//     and runs Worker.Serve in a goroutine: over tcp UCX emulates GET with
//     messages that the serving worker must progress.
//   - The reading side decodes the peer's WorkerAddress and RegionKey,
//     Connects an Endpoint, Unpacks the key on it and calls Get (GetWith
//     with options, GetInto for a registered destination such as a device
//     arena) with addresses inside the region.
//
// Endpoints detect peer failure (UCP_ERR_HANDLING_MODE_PEER): a dead peer
// fails reads (IsPeerFailure) instead of hanging them, and a canceled read
// can always be ended. UCX offers only tcp, rc and dc to such endpoints,
// not shared memory.
//
// # Threads
//
// UCX workers are not thread-safe. Workers are created in
// UCS_THREAD_MODE_SERIALIZED and each Worker serializes every UCX call on
// itself, its endpoints, keys and requests with its own lock, so any
// goroutine may call any method; calls on one worker do not run in
// parallel (use several workers for parallel pulls). Serve locks its OS
// thread, polls while requests arrive and sleeps on the worker's event
// descriptor (UCP_FEATURE_WAKEUP, ucp_worker_arm) when idle. Get polls the
// worker itself while its chunks are in flight: spinning while UCX makes
// progress, sleeping briefly between polls when it waits on a slow link.
//
// # What is checked before UCX sees peer bytes
//
// UCX parses worker addresses and packed rkeys without knowing their length
// and trusts their contents; garbage can crash it. Before any call:
// WorkerAddress and RegionKey decode from envelopes with a magic, a format
// version, a length and a CRC-32C (truncation and corruption are
// ErrMalformed); a worker address must be 2 bytes to 64 KiB with a known
// UCX address version in its first byte; a packed rkey is walked as UCX
// 1.13–1.16 lay it out (memory-domain map, memory type, one
// length-prefixed key per domain, optional device distances) and must end
// exactly; region bounds must not wrap; Get checks that the read lies
// inside the region. What is not checked: the internals of UCX's address
// format (devices, interfaces) and of each domain's key bytes — a peer that
// crafts those can crash the process (random domain keys fault inside
// ucp_ep_rkey_unpack when shared-memory transports are enabled; a worker
// address with random bytes changed can abort ucp_ep_create on an
// assertion), which is why these bytes must come only from authenticated
// peers. Copies
// handed to UCX carry 4 KiB of zeroed slack so that a short payload is
// read as zeros, not past its end. Over tcp the serving UCX answers a GET
// by copying from whatever address the request names, registered or not:
// a peer that can reach a worker and knows its address can read the whole
// serving process. Registration confines peers only on RDMA, where the NIC
// checks the rkey; elsewhere a closed network and authentication before
// addresses are exchanged are what confine them.
//
// # Environment
//
// Transports and devices are UCX's settings (UCX_TLS, UCX_NET_DEVICES, ...),
// read when a Context is made. internal/ucx sets UCX_ERROR_SIGNALS="" before
// loading libucp unless it is set (UCX's handlers would replace the Go
// runtime's), and UCX_LOG_FILE=stderr unless it is set (UCX's default,
// stdout, would mix its warnings into output scripts read).
package ucx
