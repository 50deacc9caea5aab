package diag

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math/rand/v2"
	"os"
	"runtime"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/internal/seeddata"
)

// BenchIPCCmd measures what sharing GPU memory between two processes costs:
// the latency of each IPC call, and the bandwidth of reading another
// process's memory next to the in-process copy (the hardware reference) and
// next to the host-staged hand-over people use instead. It re-executes this
// program as the exporting process: 'cudaipc bench ipc'.
type BenchIPCCmd struct {
	Size    bytesize.Size `help:"Bytes of the large allocation and of every bandwidth copy (default ${default})." default:"1GiB" placeholder:"BYTES"`
	Iters   int           `help:"Repetitions of each latency (default ${default})." default:"200" placeholder:"N"`
	BWIters int           `help:"Repetitions of each bandwidth copy (default ${default})." name:"bw-iters" default:"20" placeholder:"N"`
	JSON    bool          `help:"Print the report as JSON (the shape scripts/bench/compare.py reads)."`
}

const (
	ipcSmall  = 1 << 20 // the "1 MiB" allocation of the latency rows
	ipcWarmup = 5       // untimed repetitions before each latency loop
	bwWarmup  = 3       // untimed copies before each bandwidth loop
	peerIters = 20      // cap for peer opens: each maps over NVLink (docs/driver-facts.md: 9-13 ms the first time)

	// stagingFD is the exporter's file descriptor of the shared memfd
	// (the first of exec.Cmd.ExtraFiles).
	stagingFD = 3
	// hostStaging says how the host_staged row moves the bytes.
	hostStaging = "the exporter copies the buffer D2H into pinned memory (cuMemcpyDtoH), then into a memfd shared with the importer (CPU copy, %d threads); the importer copies it out into its pinned memory and H2D (cuMemcpyHtoD); timed from the importer's request to its H2D completing; host_staged_dma counts the two DMA copies only, the floor of any host-staged path"
)

func (c *BenchIPCCmd) validate() error {
	switch {
	case c.Size < ipcSmall:
		return usagef("--size %s: must be at least 1 MiB", c.Size)
	case c.Iters < 1:
		return usagef("--iters %d: must be at least 1", c.Iters)
	case c.BWIters < 1:
		return usagef("--bw-iters %d: must be at least 1", c.BWIters)
	}
	return nil
}

// Run measures and prints the report; progress goes to e.Stderr.
func (c *BenchIPCCmd) Run(e *Env) error {
	if err := c.validate(); err != nil {
		return err
	}
	devs, err := cudaipc.Devices()
	if errors.Is(err, cudaipc.ErrNoDriver) { // its message says what to install
		return fmt.Errorf("bench ipc: %w", err)
	}
	if err != nil {
		return fmt.Errorf("bench ipc: %w: run 'cudaipc doctor'", err)
	}
	if len(devs) == 0 {
		return fmt.Errorf("bench ipc: %w", errNoGPU)
	}
	r, err := c.bench(e.Ctx, devs, e.Stderr)
	if err != nil {
		return fmt.Errorf("bench ipc: %w", err)
	}
	if c.JSON {
		return printJSON(e.Stdout, r)
	}
	return writeIPCTable(e.Stdout, r)
}

// ipcBench holds what one run owns; close releases it in the right order
// (mappings before the exporter frees).
type ipcBench struct {
	c        *BenchIPCCmd
	dev      *cudaipc.Device
	peer     *cudaipc.Device // nil on one GPU or without peer access
	progress io.Writer
	r        *ipcBenchReport
	cleanup  []func()
}

func (b *ipcBench) onClose(f func()) { b.cleanup = append(b.cleanup, f) }

func (b *ipcBench) close() {
	for i := len(b.cleanup) - 1; i >= 0; i-- {
		b.cleanup[i]()
	}
}

func (b *ipcBench) step(format string, args ...any) {
	fmt.Fprintf(b.progress, "bench ipc: "+format+"\n", args...)
}

func (b *ipcBench) lat(key string, d []time.Duration) { b.r.Metrics[key] = latencyStat(d) }

func (b *ipcBench) bw(key, ref string, d []time.Duration) {
	s := bandwidthStat(int64(b.c.Size), d)
	s.Ref = ref
	b.r.Metrics[key] = s
}

func (c *BenchIPCCmd) bench(ctx context.Context, devs []*cudaipc.Device, progress io.Writer) (*ipcBenchReport, error) {
	b := &ipcBench{c: c, dev: devs[0], progress: progress}
	defer b.close()
	b.r = &ipcBenchReport{
		Tool: "cudaipc-go", Device: b.dev.Name(), GPUs: len(devs), Size: int64(c.Size),
		Iters: c.Iters, BWIters: c.BWIters, Metrics: map[string]ipcStat{},
	}
	if len(devs) > 1 {
		if ok, err := b.dev.CanAccessPeer(devs[1]); err == nil && ok {
			b.peer = devs[1]
		} else {
			b.r.Notes = append(b.r.Notes, "GPU 0 cannot access GPU 1: peer rows skipped")
		}
	}
	// This process holds a source and a destination of Size bytes; the
	// exporter one more on GPU 0 (and one on GPU 1).
	if free, _, err := b.dev.MemInfo(); err == nil && uint64(3*c.Size+8*ipcSmall) > free {
		return nil, usagef("--size %s needs 3x that free on GPU 0, which has %s free: pass a smaller --size", bytesize.Format(int64(c.Size)), bytesize.Format(int64(free)))
	}
	if err := b.export(); err != nil {
		return nil, err
	}
	ex, err := b.startExporter(ctx, devs)
	if err != nil {
		return nil, err
	}
	if err := b.latencies(ex); err != nil {
		return nil, err
	}
	if err := b.bandwidths(ex); err != nil {
		return nil, err
	}
	b.r.setRatios()
	return b.r, nil
}

// export times cuIpcGetMemHandle in this process: first on fresh
// allocations (the driver sets up the export), then again on each.
func (b *ipcBench) export() error {
	b.step("export latency (%d fresh 1 MiB allocations)", b.c.Iters)
	bufs := make([]*cudaipc.Buffer, 0, b.c.Iters+ipcWarmup)
	defer func() {
		for _, x := range bufs {
			x.Free()
		}
	}()
	for range b.c.Iters + ipcWarmup {
		x, err := b.dev.Alloc(ipcSmall)
		if err != nil {
			return err
		}
		bufs = append(bufs, x)
	}
	for _, round := range []string{"export_first", "export_again"} {
		var d []time.Duration
		for i, x := range bufs {
			t0 := time.Now()
			if _, err := x.MemHandle(); err != nil {
				return err
			}
			if i >= ipcWarmup {
				d = append(d, time.Since(t0))
			}
		}
		b.lat(round, d)
	}
	return nil
}

// The exporter's side of the conversation: one JSON value a line.
type (
	benchExportConfig struct {
		Size    int64          `json:"size"`
		Devices []cudaipc.UUID `json:"devices"` // GPU 0 of the importer; its GPU 1 when peer rows run
		Seed    uint64         `json:"seed"`
		Threads int            `json:"threads"`
	}
	benchExportHello struct {
		Pid      int                 `json:"pid"`
		Small    cudaipc.MemHandle   `json:"small"`
		Large    cudaipc.MemHandle   `json:"large"`
		Peer     cudaipc.MemHandle   `json:"peer"` // zero without a peer GPU
		Event    cudaipc.EventHandle `json:"event"`
		SmallCRC uint32              `json:"small_crc"` // of Small, and of the first MiB of Large and Peer
		LargeCRC uint32              `json:"large_crc"` // of Large and of Peer: same bytes
		Err      string              `json:"err,omitempty"`
	}
	benchExportRequest struct {
		Op     string `json:"op"`     // "stage" or "exit"
		Poison bool   `json:"poison"` // clear the pinned buffer first, so a copy that did nothing shows
	}
	benchExportReply struct {
		D2H  time.Duration `json:"d2h"`
		Copy time.Duration `json:"copy"`
		Err  string        `json:"err,omitempty"`
	}
)

// exporterConn is the importer's side of the conversation.
type exporterConn struct {
	hello   benchExportHello
	enc     *json.Encoder
	dec     *json.Decoder
	staging []byte // the shared memfd, mapped here too
}

func (e *exporterConn) stage(poison bool) (benchExportReply, error) {
	var rep benchExportReply
	if err := e.enc.Encode(benchExportRequest{Op: "stage", Poison: poison}); err != nil {
		return rep, fmt.Errorf("exporter process: %w", err)
	}
	if err := e.dec.Decode(&rep); err != nil {
		return rep, fmt.Errorf("exporter process: %w", err)
	}
	if rep.Err != "" {
		return rep, errors.New("exporter process: " + rep.Err)
	}
	return rep, nil
}

func (b *ipcBench) startExporter(ctx context.Context, devs []*cudaipc.Device) (*exporterConn, error) {
	cfg := benchExportConfig{Size: int64(b.c.Size), Devices: []cudaipc.UUID{b.dev.UUID()}, Seed: rand.Uint64(), Threads: copyThreads()}
	if b.peer != nil {
		cfg.Devices = append(cfg.Devices, devs[1].UUID())
	}
	b.step("starting the exporter process (%s of random data on %d GPU(s))", bytesize.Format(int64(b.c.Size)), len(cfg.Devices))
	fd, err := unix.MemfdCreate("cudaipc-bench-staging", unix.MFD_CLOEXEC)
	if err != nil {
		return nil, fmt.Errorf("memfd_create: %w", err)
	}
	memfd := os.NewFile(uintptr(fd), "cudaipc-bench-staging")
	b.onClose(func() { memfd.Close() })
	if err := memfd.Truncate(int64(b.c.Size)); err != nil {
		return nil, fmt.Errorf("memfd: %w", err)
	}
	staging, err := unix.Mmap(fd, 0, int(b.c.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mmap of the staging memfd: %w", err)
	}
	b.onClose(func() { unix.Munmap(staging) })

	h, err := startHelper(ctx, "bench-exporter", cfg, []*os.File{memfd})
	if err != nil {
		return nil, err
	}
	ex := &exporterConn{enc: json.NewEncoder(h.stdin), dec: json.NewDecoder(h.stdout), staging: staging}
	b.onClose(func() {
		_ = ex.enc.Encode(benchExportRequest{Op: "exit"})
		_ = h.wait(30 * time.Second)
	})
	if err := ex.dec.Decode(&ex.hello); err != nil {
		return nil, fmt.Errorf("the exporter process stopped%s", h.why())
	}
	if ex.hello.Err != "" {
		return nil, errors.New("exporter process: " + ex.hello.Err)
	}
	return ex, nil
}

func (b *ipcBench) latencies(ex *exporterConn) error {
	n := b.c.Iters
	h := ex.hello
	openClose := func(key string, h cudaipc.MemHandle, iters int) error {
		// One checked round first: the mapping shows the exporter's bytes
		// (every exported allocation starts with the same first MiB).
		p, err := b.dev.OpenMemHandle(h, cudaipc.LazyEnablePeerAccess)
		if err != nil {
			return fmt.Errorf("open %s: %w", key, err)
		}
		got := make([]byte, ipcSmall)
		err = b.dev.CopyFromDevice(got, p)
		if cerr := b.dev.CloseMemHandle(p); err == nil {
			err = cerr
		}
		if err != nil {
			return err
		}
		if crc32.ChecksumIEEE(got) != ex.hello.SmallCRC {
			return fmt.Errorf("the %s mapping does not hold the exporter's bytes", key)
		}
		var open, cl []time.Duration
		for i := range iters + ipcWarmup {
			t0 := time.Now()
			p, err := b.dev.OpenMemHandle(h, cudaipc.LazyEnablePeerAccess)
			t1 := time.Now()
			if err != nil {
				return fmt.Errorf("open %s: %w", key, err)
			}
			if err := b.dev.CloseMemHandle(p); err != nil {
				return fmt.Errorf("close %s: %w", key, err)
			}
			if i >= ipcWarmup {
				open, cl = append(open, t1.Sub(t0)), append(cl, time.Since(t1))
			}
		}
		b.lat("open_cold_"+key, open)
		b.lat("close_"+key, cl)
		return nil
	}
	b.step("open/close latency, 1 MiB and %s, %d times each", bytesize.Format(int64(b.c.Size)), n)
	if err := openClose("1mib", h.Small, n); err != nil {
		return err
	}
	if err := openClose("large", h.Large, n); err != nil {
		return err
	}

	keep, err := b.dev.OpenMemHandle(h.Small, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		return err
	}
	var open, cl []time.Duration
	for i := range n + ipcWarmup {
		t0 := time.Now()
		p, err := b.dev.OpenMemHandle(h.Small, cudaipc.LazyEnablePeerAccess)
		t1 := time.Now()
		if err != nil {
			b.dev.CloseMemHandle(keep)
			return err
		}
		if p != keep {
			b.dev.CloseMemHandle(p)
			b.dev.CloseMemHandle(keep)
			return fmt.Errorf("a second open of a handle returned %#x, the first %#x", p, keep)
		}
		if err := b.dev.CloseMemHandle(p); err != nil {
			b.dev.CloseMemHandle(keep)
			return err
		}
		if i >= ipcWarmup {
			open, cl = append(open, t1.Sub(t0)), append(cl, time.Since(t1))
		}
	}
	if err := b.dev.CloseMemHandle(keep); err != nil {
		return err
	}
	b.lat("open_already_open", open)
	b.lat("close_decrement", cl)

	b.step("IPC event open latency, %d times", n)
	var evOpen []time.Duration
	for i := range n + ipcWarmup {
		t0 := time.Now()
		ev, err := b.dev.OpenEventHandle(h.Event)
		d := time.Since(t0)
		if err != nil {
			return fmt.Errorf("event open: %w", err)
		}
		if err := ev.Close(); err != nil {
			return err
		}
		if i >= ipcWarmup {
			evOpen = append(evOpen, d)
		}
	}
	b.lat("event_open", evOpen)

	if b.peer != nil {
		b.step("open latency of GPU 1's memory from GPU 0, %d times", min(n, peerIters))
		if err := openClose("peer", h.Peer, min(n, peerIters)); err != nil {
			return err
		}
		delete(b.r.Metrics, "close_peer") // not a row: the unmap cost is the same as close_large
	}
	return nil
}

// copyTimer times device copies on one stream with a pair of events.
type copyTimer struct {
	s          *cudaipc.Stream
	start, end *cudaipc.Event
}

func (b *ipcBench) newCopyTimer() (*copyTimer, error) {
	s, err := b.dev.NewStream()
	if err != nil {
		return nil, err
	}
	b.onClose(func() { s.Close() })
	start, err := b.dev.NewEvent(cudaipc.EventDefault)
	if err != nil {
		return nil, err
	}
	b.onClose(func() { start.Close() })
	end, err := b.dev.NewEvent(cudaipc.EventDefault)
	if err != nil {
		return nil, err
	}
	b.onClose(func() { end.Close() })
	return &copyTimer{s, start, end}, nil
}

// time copies n bytes from src to dst reps times after bwWarmup untimed
// copies, timing each on the GPU.
func (t *copyTimer) time(dst, src cudaipc.DevicePtr, n int64, reps int) ([]time.Duration, error) {
	d := make([]time.Duration, 0, reps)
	for i := range reps + bwWarmup {
		if err := t.start.Record(t.s); err != nil {
			return nil, err
		}
		if err := t.s.CopyAsync(dst, src, n); err != nil {
			return nil, err
		}
		if err := t.end.Record(t.s); err != nil {
			return nil, err
		}
		if err := t.end.Synchronize(); err != nil {
			return nil, err
		}
		e, err := t.end.Elapsed(t.start)
		if err != nil {
			return nil, err
		}
		if i >= bwWarmup {
			d = append(d, e)
		}
	}
	return d, nil
}

func (b *ipcBench) alloc(d *cudaipc.Device) (*cudaipc.Buffer, error) {
	x, err := d.Alloc(int64(b.c.Size))
	if err != nil {
		return nil, err
	}
	b.onClose(func() { x.Free() })
	return x, nil
}

// checkDevice reads size bytes at p through the pinned buffer host (cleared
// first) and compares their CRC with want.
func (b *ipcBench) checkDevice(what string, p cudaipc.DevicePtr, host []byte, want uint32) error {
	clear(host)
	if err := b.dev.CopyFromDevice(host, p); err != nil {
		return err
	}
	if crc32.ChecksumIEEE(host) != want {
		return fmt.Errorf("%s: the destination does not hold the source's bytes", what)
	}
	return nil
}

func (b *ipcBench) bandwidths(ex *exporterConn) error {
	n, reps := int64(b.c.Size), b.c.BWIters
	host, err := b.dev.AllocHost(n)
	if err != nil {
		return err
	}
	b.onClose(func() { host.Free() })
	hb := host.Bytes()
	seeddata.Fill(hb, rand.Uint64())
	srcCRC := crc32.ChecksumIEEE(hb)
	src, err := b.alloc(b.dev)
	if err != nil {
		return err
	}
	if _, err := src.WriteAt(hb, 0); err != nil {
		return err
	}
	dst, err := b.alloc(b.dev)
	if err != nil {
		return err
	}
	t, err := b.newCopyTimer()
	if err != nil {
		return err
	}

	b.step("in-process device copy, %s x %d", bytesize.Format(n), reps)
	if err := dst.Memset(0); err != nil {
		return err
	}
	d, err := t.time(dst.Ptr(), src.Ptr(), n, reps)
	if err != nil {
		return err
	}
	if err := b.checkDevice("d2d_local", dst.Ptr(), hb, srcCRC); err != nil {
		return err
	}
	b.bw("d2d_local", "d2d_local", d)

	b.step("copy through an imported mapping, %s x %d", bytesize.Format(n), reps)
	m, err := b.dev.OpenMemHandle(ex.hello.Large, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		return err
	}
	b.onClose(func() { b.dev.CloseMemHandle(m) })
	if err := dst.Memset(0); err != nil {
		return err
	}
	if d, err = t.time(dst.Ptr(), m, n, reps); err != nil {
		return err
	}
	if err := b.checkDevice("ipc_read", dst.Ptr(), hb, ex.hello.LargeCRC); err != nil {
		return err
	}
	b.bw("ipc_read", "d2d_local", d)

	b.step("host-staged hand-over, %s x %d", bytesize.Format(n), reps)
	var e2e, dma []time.Duration
	for i := range reps + 1 { // the first round warms up and checks the bytes
		check := i == 0
		if check {
			clear(hb)
			if err := dst.Memset(0); err != nil {
				return err
			}
		}
		t0 := time.Now()
		rep, err := ex.stage(check)
		if err != nil {
			return err
		}
		parallelCopy(hb, ex.staging)
		t1 := time.Now()
		if err := b.dev.CopyToDevice(dst.Ptr(), hb); err != nil {
			return err
		}
		t2 := time.Now()
		if check {
			if err := b.checkDevice("host_staged", dst.Ptr(), hb, ex.hello.LargeCRC); err != nil {
				return err
			}
			continue
		}
		e2e = append(e2e, t2.Sub(t0))
		dma = append(dma, rep.D2H+t2.Sub(t1))
	}
	b.bw("host_staged", "d2d_local", e2e)
	b.bw("host_staged_dma", "d2d_local", dma)
	b.r.Staging = fmt.Sprintf(hostStaging, copyThreads())

	if b.peer == nil {
		return nil
	}
	b.step("GPU 1 -> GPU 0 copies, in-process and through an imported mapping, %s x %d", bytesize.Format(n), reps)
	if err := b.dev.EnablePeerAccess(b.peer); err != nil {
		return err
	}
	psrc, err := b.alloc(b.peer)
	if err != nil {
		return err
	}
	if err := b.dev.Copy(psrc.Ptr(), src.Ptr(), n); err != nil {
		return err
	}
	if err := dst.Memset(0); err != nil {
		return err
	}
	if d, err = t.time(dst.Ptr(), psrc.Ptr(), n, reps); err != nil {
		return err
	}
	if err := b.checkDevice("peer_local", dst.Ptr(), hb, srcCRC); err != nil {
		return err
	}
	b.bw("peer_local", "peer_local", d)
	pm, err := b.dev.OpenMemHandle(ex.hello.Peer, cudaipc.LazyEnablePeerAccess)
	if err != nil {
		return err
	}
	b.onClose(func() { b.dev.CloseMemHandle(pm) })
	if err := dst.Memset(0); err != nil {
		return err
	}
	if d, err = t.time(dst.Ptr(), pm, n, reps); err != nil {
		return err
	}
	if err := b.checkDevice("peer_ipc", dst.Ptr(), hb, ex.hello.LargeCRC); err != nil {
		return err
	}
	b.bw("peer_ipc", "peer_local", d)
	return nil
}

// copyThreads is how many goroutines copy to and from the staging memfd:
// one thread copies far below the host's memory bandwidth.
func copyThreads() int { return min(runtime.GOMAXPROCS(0), 8) }

// parallelCopy copies src into dst (of equal length) in copyThreads chunks.
func parallelCopy(dst, src []byte) {
	k := copyThreads()
	chunk := (len(src) + k - 1) / k
	var wg sync.WaitGroup
	for off := 0; off < len(src); off += chunk {
		end := min(off+chunk, len(src))
		wg.Go(func() { copy(dst[off:end], src[off:end]) })
	}
	wg.Wait()
}

// benchExporter is the exporting helper process of 'cudaipc bench ipc'.
func benchExporter(env *Env, config []byte) error {
	enc := json.NewEncoder(env.Stdout)
	if err := benchExport(config, enc, json.NewDecoder(env.Stdin)); err != nil {
		// Both message types carry "err": the parent reads it whichever
		// it waits for.
		_ = enc.Encode(benchExportReply{Err: err.Error()})
		return err
	}
	return nil
}

func benchExport(config []byte, enc *json.Encoder, dec *json.Decoder) error {
	var cfg benchExportConfig
	if err := json.Unmarshal(config, &cfg); err != nil {
		return fmt.Errorf("bench-exporter configuration: %w", err)
	}
	if len(cfg.Devices) == 0 || cfg.Size < ipcSmall {
		return fmt.Errorf("bench-exporter configuration %s: no device, or a size under 1 MiB", config)
	}
	dev, err := cudaipc.DeviceByUUID(cfg.Devices[0])
	if err != nil {
		return err
	}
	staging, err := unix.Mmap(stagingFD, 0, int(cfg.Size), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return fmt.Errorf("mmap of the staging memfd: %w", err)
	}
	defer unix.Munmap(staging)
	host, err := dev.AllocHost(cfg.Size)
	if err != nil {
		return err
	}
	defer host.Free()
	hb := host.Bytes()
	seeddata.Fill(hb, cfg.Seed)
	hello := benchExportHello{Pid: os.Getpid(), SmallCRC: crc32.ChecksumIEEE(hb[:ipcSmall]), LargeCRC: crc32.ChecksumIEEE(hb)}

	upload := func(d *cudaipc.Device, size int64) (*cudaipc.Buffer, cudaipc.MemHandle, error) {
		x, err := d.Alloc(size)
		if err != nil {
			return nil, cudaipc.MemHandle{}, err
		}
		if _, err := x.WriteAt(hb[:size], 0); err != nil {
			x.Free()
			return nil, cudaipc.MemHandle{}, err
		}
		h, err := x.MemHandle()
		if err != nil {
			x.Free()
		}
		return x, h, err
	}
	small, h, err := upload(dev, ipcSmall)
	if err != nil {
		return err
	}
	defer small.Free()
	hello.Small = h
	large, h, err := upload(dev, cfg.Size)
	if err != nil {
		return err
	}
	defer large.Free()
	hello.Large = h
	if len(cfg.Devices) > 1 {
		pdev, err := cudaipc.DeviceByUUID(cfg.Devices[1])
		if err != nil {
			return err
		}
		peer, h, err := upload(pdev, cfg.Size)
		if err != nil {
			return err
		}
		defer peer.Free()
		hello.Peer = h
	}
	ev, err := dev.NewIPCEvent()
	if err != nil {
		return err
	}
	defer ev.Close()
	if err := ev.Record(nil); err != nil {
		return err
	}
	if hello.Event, err = ev.IPCHandle(); err != nil {
		return err
	}
	if err := enc.Encode(hello); err != nil {
		return err
	}
	for {
		var req benchExportRequest
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return err
		}
		switch req.Op {
		case "exit":
			return nil
		case "stage":
			if req.Poison {
				clear(hb)
			}
			t0 := time.Now()
			if _, err := large.ReadAt(hb, 0); err != nil {
				return err
			}
			t1 := time.Now()
			parallelCopy(staging, hb)
			if err := enc.Encode(benchExportReply{D2H: t1.Sub(t0), Copy: time.Since(t1)}); err != nil {
				return err
			}
		default:
			return fmt.Errorf("unknown request %q", req.Op)
		}
	}
}
