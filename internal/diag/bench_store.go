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
	Duration time.Duration `default:"5s" help:"How long to measure (default ${default})." placeholder:"D"`
	Size     bytesize.Size `default:"4KiB" help:"Size of the object the clients lease (default ${default})." placeholder:"BYTES"`
	JSON     bool          `name:"json" help:"Print one JSON object: ops_per_sec, p50_us, p99_us and more."`
}

// Help is the command's long description.
func (c *BenchStoreCmd) Help() string {
	return `Creates one object, then has N clients lease and release it in a loop for D
and reports the rate and latency of a get+release cycle (one round trip: the
release travels without waiting for its reply).
With --socket (or CUDAIPC_SOCKET) it measures that running daemon; without, it
runs an embedded store in this process.`
}

type benchStoreResult struct {
	Store     string  `json:"store"` // "embedded" or the daemon's socket
	Backend   string  `json:"backend"`
	Clients   int     `json:"clients"`
	Size      int64   `json:"size"`
	DurationS float64 `json:"duration_s"`
	Ops       int64   `json:"ops"`
	OpsPerSec float64 `json:"ops_per_sec"`
	P50US     float64 `json:"p50_us"`
	P90US     float64 `json:"p90_us"`
	P99US     float64 `json:"p99_us"`
	MaxUS     float64 `json:"max_us"`
}

// Run measures and prints the result.
func (c *BenchStoreCmd) Run(e *Env) error {
	if c.Clients < 1 || c.Duration <= 0 || c.Size <= 0 {
		return usagef("--clients, --duration and --size must be positive")
	}
	ctx := e.Ctx
	res := benchStoreResult{Store: "embedded", Clients: c.Clients, Size: int64(c.Size)}
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

	admin, err := e.dial(sock)
	if err != nil {
		return err
	}
	defer admin.Close()
	res.Backend = admin.Server().Backend
	name := fmt.Sprintf("bench-%d-%d", os.Getpid(), time.Now().UnixNano())
	obj, err := admin.Create(ctx, name, int64(c.Size), client.CreateOptions{})
	if err != nil {
		return e.explain(err, sock)
	}
	_, _ = rand.Read(obj.Bytes())
	if err := obj.Seal(ctx); err != nil {
		return e.explain(err, sock)
	}
	defer admin.Delete(context.WithoutCancel(ctx), name)

	clients := make([]*client.Client, c.Clients)
	for i := range clients {
		if clients[i], err = e.dial(sock); err != nil {
			return err
		}
		defer clients[i].Close()
		// Warm up: map the arena once, as a long-lived client would have.
		l, err := clients[i].Get(ctx, name)
		if err != nil {
			return e.explain(err, sock)
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
		return e.explain(err, sock)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	all := slices.Concat(lat...)
	slices.Sort(all)
	res.DurationS = elapsed.Seconds()
	res.Ops = int64(len(all))
	res.OpsPerSec = float64(len(all)) / elapsed.Seconds()
	res.P50US = micros(percentile(all, 50))
	res.P90US = micros(percentile(all, 90))
	res.P99US = micros(percentile(all, 99))
	res.MaxUS = micros(percentile(all, 100))

	if c.JSON {
		return printJSON(e.Stdout, res)
	}
	fmt.Fprintf(e.Stdout, "bench store: %d clients, %s object, %s store (%s backend), %.1f s\n",
		res.Clients, bytesize.Format(res.Size), res.Store, res.Backend, res.DurationS)
	fmt.Fprintf(e.Stdout, "%d get+release cycles: %.0f per second; latency p50 %.1f µs, p90 %.1f µs, p99 %.1f µs, max %.1f µs\n",
		res.Ops, res.OpsPerSec, res.P50US, res.P90US, res.P99US, res.MaxUS)
	return nil
}
