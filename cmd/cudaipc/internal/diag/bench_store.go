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
  - one round trip through the socket: N clients each asking for the
    object's description (stat) in a loop for D;
  - get+release through the socket: one object, N clients leasing and
    releasing it in a loop for D, with the lease fast path off (each cycle:
    two round trips, since Release waits for the daemon's acknowledgement);
  - first get+release with the fast path on (the default client): each
    cycle leases an object this client has not leased before, through the
    socket, and releases it through the lease table (one round trip and a
    compare-and-swap);
  - get+release through the lease fast path: the same clients leasing one
    object again and again (a release and the next get of the same object
    are compare-and-swaps in shared memory, no system call);
  - with a GPU --device, the socket path for a host object, as the reference.
It reports rates, p50/p99 latencies and their ratios to the floor.
With --socket (or CUDAIPC_SOCKET) it measures that running daemon; without, it
runs an embedded store in this process. The clients poll for their replies as
any client does (50µs; CUDAIPC_SPIN=0 turns it off), the daemon for requests
as its experimental-spin setting says (the embedded store: 50µs).`
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
	// Trips is the number of socket round trips in one operation, and
	// P50FloorTrip the p50 over the floor's per round trip.
	Trips        int     `json:"round_trips,omitempty"`
	P50FloorTrip float64 `json:"p50_over_floor_per_trip,omitempty"`
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
	// Trip is one round trip through the socket (a stat of the object).
	Trip benchPath `json:"round_trip"`
	// Socket is get+release through the socket on Device (two round
	// trips); First a first get through the socket and its release
	// through the lease table (the default client: one round trip); Fast
	// get+release through the lease fast path (the figures above);
	// HostRef the socket path for a host object, on a GPU run.
	Socket  benchPath  `json:"socket"`
	First   benchPath  `json:"first"`
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
	sock, label, stop, err := benchStore(ctx, e, max(1<<30, 2*int64(c.Size)))
	if err != nil {
		return err
	}
	defer stop()
	res.Store = label

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
	run := func(dev string, opts client.Options, mode benchMode, trips int) (benchPath, time.Duration, error) {
		lat, elapsed, err := c.measure(e, sock, admin, dev, opts, mode)
		if err != nil {
			return benchPath{}, 0, err
		}
		p := pathOf(lat, dev, c.Clients, elapsed)
		p.ratios(res.Floor, trips)
		return p, elapsed, nil
	}
	if gpu {
		p, _, err := run("host", socketOnly, cycleSame, 2)
		if err != nil {
			return err
		}
		res.HostRef = &p
	}
	if res.Trip, _, err = run(c.Device, socketOnly, statOnly, 1); err != nil {
		return err
	}
	if res.Socket, _, err = run(c.Device, socketOnly, cycleSame, 2); err != nil {
		return err
	}
	if res.HostRef != nil && res.HostRef.P50US > 0 {
		res.GPUOverHost = res.Socket.P50US / res.HostRef.P50US
	}
	if res.First, _, err = run(c.Device, client.Options{}, cycleFirst, 1); err != nil {
		return err
	}
	var elapsed time.Duration
	if res.Fast, elapsed, err = run(c.Device, client.Options{}, cycleSame, 0); err != nil {
		return err
	}
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
			fmt.Fprintf(e.Stdout, "  (%.2fx, %.2fx the floor", p.P50Floor, p.P99Floor)
			if p.Trips > 1 {
				fmt.Fprintf(e.Stdout, "; p50 %.2fx a round trip", p.P50FloorTrip)
			}
			fmt.Fprint(e.Stdout, ")")
		}
		fmt.Fprintln(e.Stdout)
	}
	row("floor: SEQPACKET ping-pong", res.Floor)
	row("one round trip (stat), socket", res.Trip)
	if res.HostRef != nil {
		row("get+release, host object", *res.HostRef)
	}
	row(fmt.Sprintf("get+release, %s object, socket", c.Device), res.Socket)
	row(fmt.Sprintf("first get+release, %s, fast path", c.Device), res.First)
	row(fmt.Sprintf("get+release, %s object, fast path", c.Device), res.Fast)
	fmt.Fprintf(e.Stdout, "fast path: %d get+release cycles: %.0f per second; latency p50 %.1f µs, p90 %.1f µs, p99 %.1f µs, max %.1f µs\n",
		res.Ops, res.OpsPerSec, res.P50US, res.P90US, res.P99US, res.MaxUS)
	if res.GPUOverHost > 0 {
		fmt.Fprintf(e.Stdout, "GPU object over host object, p50: %.2fx\n", res.GPUOverHost)
	}
	return nil
}

// benchMode is what a measured cycle does.
type benchMode int

const (
	cycleSame  benchMode = iota // get and release one object
	cycleFirst                  // get and release an object this client has not leased before
	statOnly                    // one stat of the object
)

// firstObjects is how many objects a first-get run cycles through (at most
// 256 MiB of them); a client that has leased them all is replaced by a new
// one, off the clock.
const firstObjects = 256

// measure creates one object on dev (firstObjects more for cycleFirst) and
// has c.Clients clients run mode's cycle on it for c.Duration; it returns
// every cycle's latency.
func (c *BenchStoreCmd) measure(e *Env, sock string, admin *client.Client, dev string, opts client.Options, mode benchMode) ([]time.Duration, time.Duration, error) {
	ctx := e.Ctx
	prefix := fmt.Sprintf("bench-%d-%d", os.Getpid(), time.Now().UnixNano())
	create := func(name string) error {
		obj, err := admin.Create(ctx, name, int64(c.Size), client.CreateOptions{Device: dev})
		if err != nil {
			return e.explain(err, sock)
		}
		if b := obj.Bytes(); b != nil {
			_, _ = rand.Read(b)
		} else {
			buf := make([]byte, c.Size)
			_, _ = rand.Read(buf)
			if _, err := obj.WriteAt(buf, 0); err != nil {
				return err
			}
		}
		if err := obj.Seal(ctx); err != nil {
			return e.explain(err, sock)
		}
		return nil
	}
	name := prefix
	if err := create(name); err != nil {
		return nil, 0, err
	}
	defer admin.Delete(context.WithoutCancel(ctx), name)
	var firsts []string
	if mode == cycleFirst {
		// Bounded in bytes too: large objects are fewer, and a client is
		// replaced (off the clock) more often.
		for i := range max(1, min(firstObjects, int((256<<20)/int64(c.Size)))) {
			n := fmt.Sprintf("%s-%d", prefix, i)
			if err := create(n); err != nil {
				return nil, 0, err
			}
			defer admin.Delete(context.WithoutCancel(ctx), n)
			firsts = append(firsts, n)
		}
	}

	// dial connects a client and maps the arena once, as a long-lived
	// client would have.
	dial := func() (*client.Client, error) {
		cl, err := e.dialOptions(sock, opts)
		if err != nil {
			return nil, err
		}
		l, err := cl.Get(ctx, name)
		if err != nil {
			cl.Close()
			return nil, e.explain(err, sock)
		}
		_ = l.Release()
		return cl, nil
	}
	clients := make([]*client.Client, c.Clients)
	for i := range clients {
		cl, err := dial()
		if err != nil {
			return nil, 0, err
		}
		clients[i] = cl
	}
	defer func() {
		for _, cl := range clients {
			cl.Close()
		}
	}()

	lat := make([][]time.Duration, c.Clients)
	errs := make([]error, c.Clients)
	var wg sync.WaitGroup
	start := time.Now()
	end := start.Add(c.Duration)
	for i := range clients {
		wg.Go(func() {
			next := 0 // the next of firsts to lease
			for ctx.Err() == nil {
				if mode == cycleFirst && next == len(firsts) {
					clients[i].Close()
					cl, err := dial()
					if err != nil {
						errs[i] = err
						return
					}
					clients[i], next = cl, 0
				}
				t := time.Now()
				if !t.Before(end) {
					return
				}
				var err error
				switch mode {
				case statOnly:
					_, err = clients[i].Stat(ctx, name)
				default:
					n := name
					if mode == cycleFirst {
						n = firsts[next]
						next++
					}
					var l *client.Lease
					if l, err = clients[i].Get(ctx, n); err == nil {
						err = l.Release()
					}
				}
				if err != nil {
					if ctx.Err() == nil {
						errs[i] = err
					}
					return
				}
				lat[i] = append(lat[i], time.Since(t))
			}
		})
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

// ratios sets p's ratios to the floor; trips is the number of socket
// round trips in one of p's operations (0: none).
func (p *benchPath) ratios(floor benchPath, trips int) {
	if floor.P50US > 0 && floor.P99US > 0 {
		p.P50Floor, p.P99Floor = p.P50US/floor.P50US, p.P99US/floor.P99US
		if trips > 0 {
			p.Trips, p.P50FloorTrip = trips, p.P50Floor/float64(trips)
		}
	}
}
