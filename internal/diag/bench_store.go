package diag

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
)

// BenchStoreCmd measures get+release round trips against the object store:
// 'cudaipc bench store'.
type BenchStoreCmd struct {
	Clients  int           `default:"8" help:"Concurrent clients, each with its own connection (default ${default})." placeholder:"N"`
	Duration time.Duration `default:"5s" help:"How long to measure each path (default ${default})." placeholder:"D"`
	Size     bytesize.Size `default:"4KiB" help:"Size of the object the clients lease (default ${default})." placeholder:"BYTES"`
	Device   string        `default:"host" help:"Where the object lives: host, a GPU ordinal or a GPU UUID (default ${default}). A GPU run measures a host object too, as its reference." placeholder:"DEV"`
	JSON     bool          `name:"json" help:"Print one JSON object: ops_per_sec, p50_us, p99_us, the floor and the ratios."`
}

// Help is the command's long description.
func (c *BenchStoreCmd) Help() string {
	return `Measures, in one run:
  - the floor: a raw SOCK_SEQPACKET ping-pong (64 bytes) between this process
    and a helper process, one pair, blocking system calls;
  - get+release through the socket: one object, N clients leasing and
    releasing it in a loop for D, with the lease fast path off (each cycle:
    two round trips, since Release waits for the daemon's acknowledgement);
  - get+release through the lease fast path: the same clients with it on
    (a release and the next get of the same object are compare-and-swaps in
    shared memory, no system call);
  - with a GPU --device, the socket path for a host object, as the reference.
It reports rates, p50/p99 latencies and their ratios to the floor.
With --socket (or CUDAIPC_SOCKET) it measures that running daemon; without, it
runs an embedded store in this process.`
}

// benchPath is the measurement of one path.
type benchPath struct {
	Device    string  `json:"device"`
	Clients   int     `json:"clients"`
	Ops       int64   `json:"ops"`
	OpsPerSec float64 `json:"ops_per_sec"`
	P50US     float64 `json:"p50_us"`
	P90US     float64 `json:"p90_us"`
	P99US     float64 `json:"p99_us"`
	MaxUS     float64 `json:"max_us"`
	// Ratios of the latencies to the floor's.
	P50Floor float64 `json:"p50_over_floor,omitempty"`
	P99Floor float64 `json:"p99_over_floor,omitempty"`
}

type benchStoreResult struct {
	Store     string  `json:"store"` // "embedded" or the daemon's socket
	Backend   string  `json:"backend"`
	Device    string  `json:"device"`
	Clients   int     `json:"clients"`
	Size      int64   `json:"size"`
	DurationS float64 `json:"duration_s"`
	Ops       int64   `json:"ops"`
	OpsPerSec float64 `json:"ops_per_sec"`
	P50US     float64 `json:"p50_us"`
	P90US     float64 `json:"p90_us"`
	P99US     float64 `json:"p99_us"`
	MaxUS     float64 `json:"max_us"`

	// Floor is the raw SEQPACKET ping-pong between two processes.
	Floor benchPath `json:"floor"`
	// Socket is get+release through the socket on Device; Fast the same
	// through the lease fast path (the figures above); HostRef the socket
	// path for a host object, on a GPU run.
	Socket  benchPath  `json:"socket"`
	Fast    benchPath  `json:"fast"`
	HostRef *benchPath `json:"host_ref,omitempty"`
	// GPUOverHost is Socket's p50 over HostRef's.
	GPUOverHost float64 `json:"gpu_over_host_p50,omitempty"`
	// SocketOverFast is Socket's p50 over Fast's.
	SocketOverFast float64 `json:"socket_over_fast_p50,omitempty"`
}

// Run measures and prints the result.
func (c *BenchStoreCmd) Run(e *Env) error {
	if c.Clients < 1 || c.Duration <= 0 || c.Size <= 0 {
		return usagef("--clients, --duration and --size must be positive")
	}
	ctx := e.Ctx
	res := benchStoreResult{Store: "embedded", Clients: c.Clients, Size: int64(c.Size), Device: c.Device}
	sock := e.Socket
	if sock == "" {
		emb, err := startEmbedded(ctx, e, max(1<<30, 2*int64(c.Size)), "")
		if err != nil {
			return err
		}
		defer emb.Close()
		sock = emb.socket
	} else {
		res.Store = sock
	}

	floor, err := pingPongFloor(ctx, c.Duration)
	if err != nil {
		return err
	}
	res.Floor = pathOf(floor, "", 1, c.Duration)

	admin, err := e.dial(sock)
	if err != nil {
		return err
	}
	defer admin.Close()
	res.Backend = admin.Server().Backend
	gpu := c.Device != "" && c.Device != "host"
	socketOnly := client.Options{NoFastPath: true}
	if gpu {
		lat, elapsed, err := c.measure(e, sock, admin, "host", socketOnly)
		if err != nil {
			return err
		}
		p := pathOf(lat, "host", c.Clients, elapsed)
		p.ratios(res.Floor)
		res.HostRef = &p
	}
	lat, elapsed, err := c.measure(e, sock, admin, c.Device, socketOnly)
	if err != nil {
		return err
	}
	res.Socket = pathOf(lat, c.Device, c.Clients, elapsed)
	res.Socket.ratios(res.Floor)
	if res.HostRef != nil && res.HostRef.P50US > 0 {
		res.GPUOverHost = res.Socket.P50US / res.HostRef.P50US
	}
	lat, elapsed, err = c.measure(e, sock, admin, c.Device, client.Options{})
	if err != nil {
		return err
	}
	res.Fast = pathOf(lat, c.Device, c.Clients, elapsed)
	res.Fast.ratios(res.Floor)
	if res.Fast.P50US > 0 {
		res.SocketOverFast = res.Socket.P50US / res.Fast.P50US
	}
	res.DurationS = elapsed.Seconds()
	res.Ops, res.OpsPerSec = res.Fast.Ops, res.Fast.OpsPerSec
	res.P50US, res.P90US, res.P99US, res.MaxUS = res.Fast.P50US, res.Fast.P90US, res.Fast.P99US, res.Fast.MaxUS

	if c.JSON {
		return printJSON(e.Stdout, res)
	}
	fmt.Fprintf(e.Stdout, "bench store: %d clients, %s object on %s, %s store (%s backend), %.1f s a path\n",
		res.Clients, bytesize.Format(res.Size), c.Device, res.Store, res.Backend, res.DurationS)
	row := func(what string, p benchPath) {
		fmt.Fprintf(e.Stdout, "  %-34s %10.0f/s  p50 %7.1f µs  p99 %7.1f µs", what, p.OpsPerSec, p.P50US, p.P99US)
		if p.P50Floor > 0 {
			fmt.Fprintf(e.Stdout, "  (%.2fx, %.2fx the floor)", p.P50Floor, p.P99Floor)
		}
		fmt.Fprintln(e.Stdout)
	}
	row("floor: SEQPACKET ping-pong", res.Floor)
	if res.HostRef != nil {
		row("get+release, host object", *res.HostRef)
	}
	row(fmt.Sprintf("get+release, %s object, socket", c.Device), res.Socket)
	row(fmt.Sprintf("get+release, %s object, fast path", c.Device), res.Fast)
	fmt.Fprintf(e.Stdout, "fast path: %d get+release cycles: %.0f per second; latency p50 %.1f µs, p90 %.1f µs, p99 %.1f µs, max %.1f µs\n",
		res.Ops, res.OpsPerSec, res.P50US, res.P90US, res.P99US, res.MaxUS)
	if res.GPUOverHost > 0 {
		fmt.Fprintf(e.Stdout, "GPU object over host object, p50: %.2fx\n", res.GPUOverHost)
	}
	return nil
}

// measure creates one object on dev and has c.Clients clients lease and
// release it for c.Duration; it returns every cycle's latency.
func (c *BenchStoreCmd) measure(e *Env, sock string, admin *client.Client, dev string, opts client.Options) ([]time.Duration, time.Duration, error) {
	ctx := e.Ctx
	name := fmt.Sprintf("bench-%d-%d", os.Getpid(), time.Now().UnixNano())
	obj, err := admin.Create(ctx, name, int64(c.Size), client.CreateOptions{Device: dev})
	if err != nil {
		return nil, 0, e.explain(err, sock)
	}
	if b := obj.Bytes(); b != nil {
		_, _ = rand.Read(b)
	} else {
		buf := make([]byte, c.Size)
		_, _ = rand.Read(buf)
		if _, err := obj.WriteAt(buf, 0); err != nil {
			return nil, 0, err
		}
	}
	if err := obj.Seal(ctx); err != nil {
		return nil, 0, e.explain(err, sock)
	}
	defer admin.Delete(context.WithoutCancel(ctx), name)

	clients := make([]*client.Client, c.Clients)
	for i := range clients {
		if clients[i], err = e.dialOptions(sock, opts); err != nil {
			return nil, 0, err
		}
		defer clients[i].Close()
		// Warm up: map the arena once, as a long-lived client would have.
		l, err := clients[i].Get(ctx, name)
		if err != nil {
			return nil, 0, e.explain(err, sock)
		}
		_ = l.Release()
	}

	lat := make([][]time.Duration, c.Clients)
	errs := make([]error, c.Clients)
	var wg sync.WaitGroup
	start := time.Now()
	end := start.Add(c.Duration)
	for i, cl := range clients {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				t := time.Now()
				if !t.Before(end) {
					return
				}
				l, err := cl.Get(ctx, name)
				if err == nil {
					err = l.Release()
				}
				if err != nil {
					if ctx.Err() == nil {
						errs[i] = err
					}
					return
				}
				lat[i] = append(lat[i], time.Since(t))
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if err := errors.Join(errs...); err != nil {
		return nil, 0, e.explain(err, sock)
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, err
	}
	return slices.Concat(lat...), elapsed, nil
}

func pathOf(lat []time.Duration, dev string, clients int, elapsed time.Duration) benchPath {
	slices.Sort(lat)
	return benchPath{
		Device: dev, Clients: clients, Ops: int64(len(lat)),
		OpsPerSec: float64(len(lat)) / elapsed.Seconds(),
		P50US:     micros(percentile(lat, 50)), P90US: micros(percentile(lat, 90)),
		P99US: micros(percentile(lat, 99)), MaxUS: micros(percentile(lat, 100)),
	}
}

func (p *benchPath) ratios(floor benchPath) {
	if floor.P50US > 0 && floor.P99US > 0 {
		p.P50Floor, p.P99Floor = p.P50US/floor.P50US, p.P99US/floor.P99US
	}
}
