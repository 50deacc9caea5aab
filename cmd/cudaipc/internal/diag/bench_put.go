package diag

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"os"
	"slices"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
)

// BenchPutCmd measures the Go client's put of a large GPU object against
// an in-process device-to-device copy of the same bytes: 'cudaipc bench put'.
type BenchPutCmd struct {
	Size   bytesize.Size `default:"1GiB" help:"Size of each object (default ${default})." placeholder:"BYTES"`
	Device string        `default:"0" help:"The GPU, by ordinal or UUID (default ${default})." placeholder:"DEV"`
	Count  int           `default:"8" help:"Puts (and copies) to measure (default ${default})." placeholder:"N"`
	JSON   bool          `name:"json" help:"Print one JSON object: the medians, GB/s and the ratio put/copy."`
}

// Help is the command's long description.
func (c *BenchPutCmd) Help() string {
	return `Measures, in one run, on one GPU:
  - the reference: an in-process device-to-device copy of --size bytes
    (cuMemcpy, waited for), --count times;
  - put: Create on the GPU, the same copy into the object's mapping, Seal,
    --count times (each object is deleted before the next, untimed, so that
    the daemon may reuse its arena as a producer's next put would);
  - the phases of put (create, copy, seal) separately;
  - the same put with the copy queued on a stream, an interprocess event
    signalled after it and Object.SealAfter (the seal's round trip overlaps
    the copy).
It reports medians, GB/s and put/copy. With --socket (or CUDAIPC_SOCKET) it
measures that running daemon; without, it runs an embedded store.`
}

type benchPutResult struct {
	Store        string  `json:"store"`
	Device       string  `json:"device"`
	Bytes        int64   `json:"bytes"`
	Count        int     `json:"count"`
	CopyMedianMS float64 `json:"copy_median_ms"`
	PutMedianMS  float64 `json:"put_median_ms"`
	PutBestMS    float64 `json:"put_best_ms"`
	CreateP50US  float64 `json:"create_p50_us"`
	CopyInPutMS  float64 `json:"copy_in_put_median_ms"`
	SealP50US    float64 `json:"seal_p50_us"`
	CopyGBps     float64 `json:"copy_GBps"`
	PutGBps      float64 `json:"put_GBps"`
	Ratio        float64 `json:"ratio_put_to_copy"`
	BytesEqual   bool    `json:"bytes_equal"`
	// The same put with the copy queued on a stream and Object.SealAfter
	// (the seal's round trip overlaps the copy).
	EventPutMedianMS float64 `json:"event_put_median_ms"`
	EventRatio       float64 `json:"ratio_event_put_to_copy"`
	EventBytesEqual  bool    `json:"event_bytes_equal"`
}

// Run measures and prints the result.
func (c *BenchPutCmd) Run(e *Env) error {
	if c.Size <= 0 || c.Count < 1 {
		return usagef("--size and --count must be positive")
	}
	ctx := e.Ctx
	n := int64(c.Size)
	dev, err := cudaipc.LookupDevice(c.Device)
	if err != nil {
		return fmt.Errorf("bench put: %w", err)
	}
	res := benchPutResult{Store: "embedded", Device: dev.UUID().String(), Bytes: n, Count: c.Count}
	sock, label, stop, err := benchStore(ctx, e, 4*n)
	if err != nil {
		return err
	}
	defer stop()
	res.Store = label
	src, err := dev.Alloc(n)
	if err != nil {
		return fmt.Errorf("bench put: source buffer: %w", err)
	}
	defer src.Free()
	dst, err := dev.Alloc(n)
	if err != nil {
		return fmt.Errorf("bench put: copy buffer: %w", err)
	}
	pattern := make([]byte, 64<<20)
	_, _ = rand.Read(pattern)
	for off := int64(0); off < n; off += int64(len(pattern)) {
		if _, err := src.WriteAt(pattern[:min(int64(len(pattern)), n-off)], off); err != nil {
			return fmt.Errorf("bench put: filling the source: %w", err)
		}
	}
	copies := make([]time.Duration, 0, c.Count)
	for range c.Count + 1 {
		t := time.Now()
		if err := dev.Copy(dst.Ptr(), src.Ptr(), n); err != nil {
			return fmt.Errorf("bench put: copy: %w", err)
		}
		copies = append(copies, time.Since(t))
	}
	copies = copies[1:] // the first wakes the copy engines up
	_ = dst.Free()

	cl, err := e.dial(sock)
	if err != nil {
		return err
	}
	defer cl.Close()
	var puts, creates, copiesIn, seals []time.Duration
	for i := range c.Count + 1 {
		name := fmt.Sprintf("bench-put-%d-%d", os.Getpid(), i)
		t0 := time.Now()
		o, err := cl.Create(ctx, name, n, client.CreateOptions{Device: c.Device})
		if err != nil {
			return e.explain(err, sock)
		}
		t1 := time.Now()
		if err := dev.Copy(o.Ptr(), src.Ptr(), n); err != nil {
			_ = o.Abort(ctx)
			return fmt.Errorf("bench put: copy into the object: %w", err)
		}
		t2 := time.Now()
		if err := o.Seal(ctx); err != nil {
			return e.explain(err, sock)
		}
		t3 := time.Now()
		if i == 0 {
			// The first put maps the arena; check the bytes once.
			ok, err := sameBytes(ctx, cl, dev, name, src, n)
			if err != nil {
				return err
			}
			res.BytesEqual = ok
		} else {
			puts = append(puts, t3.Sub(t0))
			creates, copiesIn, seals = append(creates, t1.Sub(t0)), append(copiesIn, t2.Sub(t1)), append(seals, t3.Sub(t2))
		}
		if err := cl.Delete(context.WithoutCancel(ctx), name); err != nil {
			return e.explain(err, sock)
		}
	}
	evPuts, evEqual, err := eventPuts(ctx, e, cl, dev, src, n, c.Count, c.Device, sock)
	if err != nil {
		return err
	}
	res.EventBytesEqual = evEqual
	for _, s := range [][]time.Duration{copies, puts, creates, copiesIn, seals, evPuts} {
		slices.Sort(s)
	}
	ms := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }
	res.CopyMedianMS, res.PutMedianMS, res.PutBestMS = ms(percentile(copies, 50)), ms(percentile(puts, 50)), ms(puts[0])
	res.CreateP50US, res.CopyInPutMS, res.SealP50US = micros(percentile(creates, 50)), ms(percentile(copiesIn, 50)), micros(percentile(seals, 50))
	res.CopyGBps = float64(n) / percentile(copies, 50).Seconds() / 1e9
	res.PutGBps = float64(n) / percentile(puts, 50).Seconds() / 1e9
	res.Ratio = res.PutGBps / res.CopyGBps
	res.EventPutMedianMS = ms(percentile(evPuts, 50))
	res.EventRatio = percentile(copies, 50).Seconds() / percentile(evPuts, 50).Seconds()
	if c.JSON {
		return printJSON(e.Stdout, res)
	}
	fmt.Fprintf(e.Stdout, "bench put: %s objects on %s, %s store, %d puts\n", bytesize.Format(n), res.Device, res.Store, c.Count)
	fmt.Fprintf(e.Stdout, "  in-process copy  median %8.3f ms  %7.0f GB/s\n", res.CopyMedianMS, res.CopyGBps)
	fmt.Fprintf(e.Stdout, "  put              median %8.3f ms  %7.0f GB/s  (%.2fx the copy)\n", res.PutMedianMS, res.PutGBps, res.Ratio)
	fmt.Fprintf(e.Stdout, "  phases: create p50 %.1f µs, copy median %.3f ms, seal p50 %.1f µs; bytes equal: %v\n", res.CreateP50US, res.CopyInPutMS, res.SealP50US, res.BytesEqual)
	fmt.Fprintf(e.Stdout, "  put, SealAfter  median %8.3f ms  (%.2fx the copy); bytes equal: %v\n", res.EventPutMedianMS, res.EventRatio, res.EventBytesEqual)
	return nil
}

// eventPuts times count puts (after one untimed first) that queue the copy
// on a stream, signal an interprocess event and seal with SealAfter; the
// first object's bytes are compared with src.
func eventPuts(ctx context.Context, e *Env, cl *client.Client, dev *cudaipc.Device, src *cudaipc.Buffer, n int64, count int, device, sock string) ([]time.Duration, bool, error) {
	st, err := dev.NewStream()
	if err != nil {
		return nil, false, fmt.Errorf("bench put: stream: %w", err)
	}
	defer st.Close()
	ev, err := dev.NewIPCEvent()
	if err != nil {
		return nil, false, fmt.Errorf("bench put: interprocess event: %w", err)
	}
	defer ev.Close()
	var puts []time.Duration
	equal := false
	for i := range count + 1 {
		name := fmt.Sprintf("bench-put-ev-%d-%d", os.Getpid(), i)
		t0 := time.Now()
		o, err := cl.Create(ctx, name, n, client.CreateOptions{Device: device})
		if err != nil {
			return nil, false, e.explain(err, sock)
		}
		err = st.CopyAsync(o.Ptr(), src.Ptr(), n)
		if err == nil {
			err = ev.Signal(st)
		}
		if err != nil {
			_ = st.Synchronize()
			_ = o.Abort(ctx)
			return nil, false, fmt.Errorf("bench put: copy into the object: %w", err)
		}
		if err := o.SealAfter(ctx, ev); err != nil {
			return nil, false, e.explain(err, sock)
		}
		d := time.Since(t0)
		if i == 0 {
			if equal, err = sameBytes(ctx, cl, dev, name, src, n); err != nil {
				return nil, false, err
			}
		} else {
			puts = append(puts, d)
		}
		if err := cl.Delete(context.WithoutCancel(ctx), name); err != nil {
			return nil, false, e.explain(err, sock)
		}
	}
	return puts, equal, nil
}

// sameBytes leases name and compares it with src, 64 MiB at a time.
func sameBytes(ctx context.Context, cl *client.Client, dev *cudaipc.Device, name string, src *cudaipc.Buffer, n int64) (bool, error) {
	l, err := cl.Get(ctx, name)
	if err != nil {
		return false, err
	}
	defer l.Release()
	a, b := make([]byte, 64<<20), make([]byte, 64<<20)
	for off := int64(0); off < n; off += int64(len(a)) {
		k := min(int64(len(a)), n-off)
		if _, err := src.ReadAt(a[:k], off); err != nil {
			return false, err
		}
		if _, err := l.ReadAt(b[:k], off); err != nil {
			return false, err
		}
		if !bytes.Equal(a[:k], b[:k]) {
			return false, nil
		}
	}
	return true, nil
}
