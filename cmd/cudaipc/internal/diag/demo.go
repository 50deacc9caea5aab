package diag

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/internal/seeddata"
	"github.com/cudaipc/cudaipc/store"
)

// DemoCmd shares objects between two processes through an embedded store
// and reports how fast: 'cudaipc demo'.
type DemoCmd struct {
	Sizes    []bytesize.Size `default:"4KiB,64KiB,1MiB,16MiB,64MiB" sep:"," help:"Sizes of the objects to share (default ${default})." placeholder:"BYTES,..."`
	Device   string          `help:"Where the objects live: host, a GPU ordinal or UUID (default: GPU 0 when the store has the cuda backend, else host)." placeholder:"host|ORDINAL|UUID"`
	JSON     bool            `name:"json" help:"Print the results as one JSON object."`
	GPUShare string          `name:"gpu-share" default:"ipc" enum:"ipc,fd" help:"How the embedded store shares GPU arenas: ipc (legacy CUDA IPC) or fd (VMM memory sent as file descriptors, as for containers)."`
}

// Help is the command's long description.
func (c *DemoCmd) Help() string {
	return `Shows the store at work with nothing to set up: runs a store in this process (auto
backend: objects on GPU 0 where the CUDA driver sees a GPU, host memory otherwise),
starts a producer process and a consumer process, shares objects of several sizes
between them, checks every byte and reports how fast each step was. With GPU
objects it also times a device-to-device copy from the consumer's mapping, the
zero-copy path. --device host forces host objects; --gpu-share fd shares GPU arenas
as file descriptors (the container path) instead of legacy CUDA IPC handles.`
}

// DemoResult is one object's story in a DemoReport.
type DemoResult struct {
	Name            string  `json:"name"`
	Size            int64   `json:"size"`
	SHA256          string  `json:"sha256"`
	WriteGBps       float64 `json:"write_gbps"`         // producer writing its bytes into the shared mapping
	SealToGetUS     float64 `json:"seal_to_get_us"`     // producer's seal request to consumer holding the lease
	VerifyGBps      float64 `json:"verify_gbps"`        // consumer comparing every byte of the mapping
	GetReleaseP50US float64 `json:"get_release_p50_us"` // one get+release round trip, mapping cached
	// CopyGBps is a device-to-device copy from the consumer's mapping into
	// its own buffer (GPU objects only): reading in place, on the GPU.
	CopyGBps float64 `json:"d2d_copy_gbps,omitempty"`
	OK       bool    `json:"ok"`
}

// DemoReport is what the demo prints with --json.
type DemoReport struct {
	Backend string `json:"backend"`
	Device  string `json:"device"` // "host" or the GPU's UUID
	// GPUShare is how the consumer mapped the GPU objects: "ipc" or "fd";
	// empty for host objects.
	GPUShare    string       `json:"gpu_share,omitempty"`
	Socket      string       `json:"socket"`
	ProducerPID int          `json:"producer_pid"`
	ConsumerPID int          `json:"consumer_pid"`
	Objects     []DemoResult `json:"objects"`
	TotalBytes  int64        `json:"total_bytes"`
	ElapsedS    float64      `json:"elapsed_s"`
	OK          bool         `json:"ok"`
}

// Run runs the demo and prints its report; it fails when a byte differs.
func (c *DemoCmd) Run(e *Env) error {
	if len(c.Sizes) == 0 {
		return usagef("--sizes needs at least one size")
	}
	var total int64
	sizes := make([]int64, len(c.Sizes))
	for i, s := range c.Sizes {
		if s <= 0 {
			return usagef("--sizes: %d is not a positive size", s)
		}
		total += int64(s)
		sizes[i] = int64(s)
	}
	ctx := e.Ctx
	start := time.Now()
	emb, err := startEmbedded(ctx, e, max(1<<30, 2*total), c.GPUShare)
	if err != nil {
		return err
	}
	defer emb.Close()

	admin, err := client.Dial(ctx, emb.socket)
	if err != nil {
		return fmt.Errorf("demo: connecting to the embedded store: %w", err)
	}
	defer admin.Close()

	dev, err := c.device(admin.Server().Backend)
	if err != nil {
		return err
	}
	cfg := demoWorkerConfig{
		Socket: emb.socket, Prefix: fmt.Sprintf("demo-%d-%08x-", os.Getpid(), rand.Uint32()),
		Seed: rand.Uint64(), Sizes: sizes, Device: dev, Rounds: 200,
	}

	// The consumer starts first and waits in Get until the producer seals.
	cfg.Role = "consumer"
	cons, err := startWorker(ctx, cfg)
	if err != nil {
		return err
	}
	cfg.Role = "producer"
	prod, err := startWorker(ctx, cfg)
	if err != nil {
		cons.kill()
		return err
	}
	// The consumer says when it is connected, so that its start-up is not
	// counted as seal→lease latency.
	if !cons.out.Scan() || cons.out.Text() != "ready" {
		prod.kill()
		if err := cons.wait(); err != nil {
			return err
		}
		return errors.New("demo: the consumer process stopped before it was ready")
	}
	// Lock-step: the producer makes object i once the consumer has
	// finished object i-1, so the consumer is already waiting in Get and
	// seal→lease measures the store, not the consumer's backlog.
	for range c.Sizes {
		if _, err := fmt.Fprintln(prod.h.stdin, "next"); err != nil {
			break
		}
		if !prod.next() || !cons.next() {
			break
		}
	}
	prod.h.stdin.Close()
	perr := prod.wait()
	if perr != nil {
		cons.kill()
	}
	cerr := cons.wait()
	if err := errors.Join(perr, cerr); err != nil {
		return err
	}
	for _, s := range sizes {
		_ = admin.Delete(ctx, demoName(cfg.Prefix, s))
	}

	rep := DemoReport{
		Backend: admin.Server().Backend, Device: dev, Socket: emb.socket,
		ProducerPID: prod.h.cmd.Process.Pid, ConsumerPID: cons.h.cmd.Process.Pid,
		TotalBytes: total, OK: true,
	}
	for i, s := range c.Sizes {
		var p producerLine
		var q consumerLine
		if i >= len(prod.lines) || i >= len(cons.lines) {
			return errors.New("demo: a worker reported fewer objects than it was given")
		}
		_ = json.Unmarshal(prod.lines[i], &p)
		_ = json.Unmarshal(cons.lines[i], &q)
		if q.GPUShare != "" {
			rep.GPUShare = q.GPUShare
		}
		r := DemoResult{
			Name: p.Name, Size: int64(s), SHA256: q.SHA256,
			WriteGBps:       gbps(int64(s), p.FillNS),
			SealToGetUS:     float64(q.GotUnixNano-p.SealUnixNano) / 1e3,
			VerifyGBps:      gbps(int64(s), q.VerifyNS),
			GetReleaseP50US: float64(q.RoundTripP50NS) / 1e3,
			CopyGBps:        gbps(int64(s), q.CopyNS),
			OK:              q.Match && p.SHA256 == q.SHA256 && p.Name == q.Name,
		}
		rep.OK = rep.OK && r.OK
		rep.Objects = append(rep.Objects, r)
	}
	rep.ElapsedS = time.Since(start).Seconds()

	if c.JSON {
		if err := printJSON(e.Stdout, rep); err != nil {
			return err
		}
	} else {
		printDemo(e.Stdout, rep)
	}
	if !rep.OK {
		return errors.New("demo: the consumer did not read what the producer wrote: see the table above")
	}
	return nil
}

// device picks where the demo's objects live, given the store's backend:
// --device, else GPU 0 (by UUID, as the daemon names GPUs) with the cuda
// backend, else host.
func (c *DemoCmd) device(backend string) (string, error) {
	if c.Device == "" && backend != "cuda" || c.Device == "host" {
		return "host", nil
	}
	if backend != "cuda" {
		return "", usagef("--device %s: the embedded store has the %s backend (no GPU visible): use --device host", c.Device, backend)
	}
	want := c.Device
	if want == "" {
		want = "0"
	}
	dev, err := cudaipc.LookupDevice(want)
	if err != nil {
		return "", usagef("--device: %w", err)
	}
	return dev.UUID().String(), nil
}

func printDemo(w io.Writer, rep DemoReport) {
	gpu := rep.Device != "host"
	if gpu {
		fmt.Fprintf(w, "cudaipc demo: embedded store, %s backend, objects on GPU %s, socket %s\n", rep.Backend, rep.Device, rep.Socket)
		fmt.Fprintf(w, "producer (pid %d) created each object, copied random bytes into it (WriteAt) and sealed it;\n", rep.ProducerPID)
		fmt.Fprintf(w, "consumer (pid %d) waited for it, leased it, read every byte through its mapping and\n", rep.ConsumerPID)
		fmt.Fprintf(w, "compared them, and copied the object on the GPU from its mapping into a buffer of its own.\n")
		if rep.GPUShare == store.GPUShareFD {
			fmt.Fprintf(w, "GPU sharing: fd. Only names, offsets, regions and arena descriptors crossed the socket; each process imported each arena once (VMM, cuMemImportFromShareableHandle).\n\n")
		} else {
			fmt.Fprintf(w, "GPU sharing: ipc. Only names, offsets and regions crossed the socket; each process opened each arena once (cuIpcOpenMemHandle).\n\n")
		}
	} else {
		fmt.Fprintf(w, "cudaipc demo: embedded store, %s backend, socket %s\n", rep.Backend, rep.Socket)
		fmt.Fprintf(w, "producer (pid %d) created each object, wrote random bytes into it and sealed it;\n", rep.ProducerPID)
		fmt.Fprintf(w, "consumer (pid %d) waited for it, leased it and compared every byte in place.\n", rep.ConsumerPID)
		fmt.Fprintf(w, "Only names, offsets and one fd per arena crossed the socket.\n\n")
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	if gpu {
		fmt.Fprintln(tw, "size\twrite (H2D)\tseal→lease\tread (D2H)+compare\tGPU copy from mapping\tget+release p50\tcheck\t")
	} else {
		fmt.Fprintln(tw, "size\twrite\tseal→lease\tread+compare\tget+release p50\tcheck\t")
	}
	for _, r := range rep.Objects {
		check := "ok"
		if !r.OK {
			check = "MISMATCH"
		}
		if gpu {
			fmt.Fprintf(tw, "%s\t%.2f GB/s\t%.0f µs\t%.2f GB/s\t%.1f GB/s\t%.1f µs\t%s\t\n",
				bytesize.Format(r.Size), r.WriteGBps, r.SealToGetUS, r.VerifyGBps, r.CopyGBps, r.GetReleaseP50US, check)
			continue
		}
		fmt.Fprintf(tw, "%s\t%.2f GB/s\t%.0f µs\t%.2f GB/s\t%.1f µs\t%s\t\n",
			bytesize.Format(r.Size), r.WriteGBps, r.SealToGetUS, r.VerifyGBps, r.GetReleaseP50US, check)
	}
	tw.Flush()
	verdict := "every byte matched (byte-for-byte against the producer's random stream, and SHA-256)"
	if !rep.OK {
		verdict = "MISMATCH: the consumer read something other than what the producer wrote"
	}
	fmt.Fprintf(w, "\n%d objects, %s: %s, in %.2f s.\n", len(rep.Objects), bytesize.Format(rep.TotalBytes), verdict, rep.ElapsedS)
}

func gbps(n, ns int64) float64 {
	if ns <= 0 {
		return 0
	}
	return float64(n) / float64(ns)
}

func demoName(prefix string, size int64) string { return prefix + strconv.FormatInt(size, 10) }

// worker is a demo producer or consumer: a helper process that prints one
// JSON line per object.
type worker struct {
	h     *helper
	out   *bufio.Scanner
	lines [][]byte
}

func startWorker(ctx context.Context, cfg demoWorkerConfig) (*worker, error) {
	h, err := startHelper(ctx, "demo-worker", cfg, nil)
	if err != nil {
		return nil, fmt.Errorf("demo: %w", err)
	}
	return &worker{h: h, out: bufio.NewScanner(h.stdout)}, nil
}

// next reads the worker's next result line; false when it has no more.
func (w *worker) next() bool {
	if !w.out.Scan() {
		return false
	}
	w.lines = append(w.lines, slices.Clone(w.out.Bytes()))
	return true
}

func (w *worker) wait() error {
	for w.next() { // drain, so that the worker does not block on a full pipe
	}
	if err := w.h.wait(time.Minute); err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	return nil
}

func (w *worker) kill() { w.h.kill() }

// demoWorkerConfig is a demo worker's configuration.
type demoWorkerConfig struct {
	Role   string  `json:"role"` // producer or consumer
	Socket string  `json:"socket"`
	Prefix string  `json:"prefix"`
	Seed   uint64  `json:"seed"`
	Sizes  []int64 `json:"sizes"`
	Device string  `json:"device"` // where the producer creates the objects: host or a GPU UUID
	Rounds int     `json:"rounds"` // get+release round trips per object (consumer)
}

type producerLine struct {
	Name         string `json:"name"`
	FillNS       int64  `json:"fill_ns"`
	SealUnixNano int64  `json:"seal_unix_nano"`
	SHA256       string `json:"sha256"`
}

type consumerLine struct {
	Name           string `json:"name"`
	GotUnixNano    int64  `json:"got_unix_nano"`
	VerifyNS       int64  `json:"verify_ns"`
	RoundTripP50NS int64  `json:"round_trip_p50_ns"`
	SHA256         string `json:"sha256"`
	Match          bool   `json:"match"`
	MismatchAt     int64  `json:"mismatch_at"`
	CopyNS         int64  `json:"copy_ns,omitempty"`   // device-to-device copy from the mapping (GPU objects)
	GPUShare       string `json:"gpu_share,omitempty"` // how the lease's memory was shared, as --gpu-share names it
}

// demoWorker is the helper process of a demo producer or consumer.
func demoWorker(env *Env, config []byte) error {
	var c demoWorkerConfig
	if err := json.Unmarshal(config, &c); err != nil {
		return fmt.Errorf("demo-worker configuration: %w", err)
	}
	cl, err := env.dial(c.Socket)
	if err != nil {
		return err
	}
	defer cl.Close()
	if c.Device != "host" {
		// Create the GPU's context now (a fraction of a second), so that the
		// first object's seal→lease time measures sharing, not CUDA start-up.
		dev, err := cudaipc.LookupDevice(c.Device)
		if err != nil {
			return err
		}
		if err := dev.Synchronize(); err != nil {
			return err
		}
	}
	if c.Role == "consumer" {
		fmt.Fprintln(env.Stdout, "ready")
	}
	enc := json.NewEncoder(env.Stdout)
	in := bufio.NewScanner(env.Stdin)
	for _, s := range c.Sizes {
		if c.Role == "producer" && !in.Scan() {
			return nil // the demo stopped early
		}
		name := demoName(c.Prefix, s)
		var line any
		var err error
		if c.Role == "producer" {
			line, err = c.produce(env.Ctx, cl, name, s)
		} else {
			line, err = c.consume(env.Ctx, cl, name)
		}
		if err != nil {
			return err
		}
		if err := enc.Encode(line); err != nil {
			return err
		}
	}
	return nil
}

// gpuShareOf names a region kind as the store's --gpu-share does.
var gpuShareOf = map[cudaipc.Kind]string{cudaipc.KindCUDAIPC: store.GPUShareIPC, cudaipc.KindVMMFD: store.GPUShareFD}

// demoData is the object's content: random bytes that both sides derive
// from the seed and the name, so the consumer can check every byte.
func demoData(seed uint64, name string, size int64) []byte {
	return seeddata.Bytes(seeddata.Named(seed, name), int(size))
}

func (c *demoWorkerConfig) produce(ctx context.Context, cl *client.Client, name string, size int64) (producerLine, error) {
	obj, err := cl.Create(ctx, name, size, client.CreateOptions{Device: c.Device})
	if err != nil {
		return producerLine{}, err
	}
	src := demoData(c.Seed, name, size)
	t := time.Now()
	if b := obj.Bytes(); b != nil {
		copy(b, src) // the first touch of these pages is part of the cost
	} else if _, err := obj.WriteAt(src, 0); err != nil { // a GPU object
		_ = obj.Abort(ctx)
		return producerLine{}, err
	}
	fill := time.Since(t)
	sum := sha256.Sum256(src)
	sealAt := time.Now()
	if err := obj.Seal(ctx); err != nil {
		return producerLine{}, err
	}
	return producerLine{Name: name, FillNS: fill.Nanoseconds(), SealUnixNano: sealAt.UnixNano(), SHA256: hex.EncodeToString(sum[:])}, nil
}

func (c *demoWorkerConfig) consume(ctx context.Context, cl *client.Client, name string) (consumerLine, error) {
	lease, err := cl.GetWith(ctx, name, client.GetOptions{Wait: true}) // until the producer seals it
	if err != nil {
		return consumerLine{}, err
	}
	got := time.Now()
	defer lease.Release()
	b := lease.Bytes()

	line := consumerLine{Name: name, GotUnixNano: got.UnixNano(), Match: true, MismatchAt: -1}
	want := demoData(c.Seed, name, lease.Size())
	t := time.Now()
	if b == nil { // a GPU object: read it through the mapping
		b = make([]byte, lease.Size())
		if _, err := lease.ReadAt(b, 0); err != nil {
			return consumerLine{}, err
		}
	}
	line.Match = bytes.Equal(b, want) // reads every byte of the shared mapping
	line.VerifyNS = time.Since(t).Nanoseconds()
	if dev := lease.CUDADevice(); dev != nil {
		line.GPUShare = gpuShareOf[lease.Mapping().Region().Kind]
		if line.CopyNS, err = copyFromMapping(dev, lease.Ptr(), lease.Size()); err != nil {
			return consumerLine{}, err
		}
	}
	if !line.Match {
		for i := range b {
			if b[i] != want[i] {
				line.MismatchAt = int64(i)
				break
			}
		}
	}
	sum := sha256.Sum256(b)
	line.SHA256 = hex.EncodeToString(sum[:])

	lat := make([]time.Duration, 0, c.Rounds)
	for range c.Rounds {
		t := time.Now()
		l, err := cl.Get(ctx, name)
		if err != nil {
			return consumerLine{}, err
		}
		if err := l.Release(); err != nil {
			return consumerLine{}, err
		}
		lat = append(lat, time.Since(t))
	}
	slices.Sort(lat)
	line.RoundTripP50NS = percentile(lat, 50).Nanoseconds()
	return line, nil
}

// copyFromMapping copies a GPU object from the consumer's mapping into a
// buffer of the consumer's own on the same GPU, the way a consumer uses
// shared memory without staging it through the host, and returns the best
// time of a few copies.
func copyFromMapping(dev *cudaipc.Device, src cudaipc.DevicePtr, size int64) (int64, error) {
	dst, err := dev.Alloc(size)
	if err != nil {
		return 0, fmt.Errorf("demo: allocating the consumer's copy: %w", err)
	}
	defer dst.Free()
	best := int64(math.MaxInt64)
	for range 4 { // the first copy warms up
		t := time.Now()
		if err := dev.Copy(dst.Ptr(), src, size); err != nil {
			return 0, fmt.Errorf("demo: device-to-device copy: %w", err)
		}
		// A device-to-device copy does not wait for the GPU.
		if err := dev.Synchronize(); err != nil {
			return 0, err
		}
		best = min(best, time.Since(t).Nanoseconds())
	}
	return best, nil
}
