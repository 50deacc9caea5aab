package diag

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/cluster"
	"github.com/cudaipc/cudaipc/cluster/etcddir"
	"github.com/cudaipc/cudaipc/cluster/node"
	"github.com/cudaipc/cudaipc/cluster/ucxtransport"
	"github.com/cudaipc/cudaipc/internal/bytesize"
	"github.com/cudaipc/cudaipc/store"
	"github.com/cudaipc/cudaipc/transport/ucx"
	"github.com/cudaipc/cudaipc/transport/ucx/ucxperf"
)

// BenchClusterCmd measures gets of objects another daemon holds against
// ucx_perftest on the same link in the same run: 'cudaipc bench cluster'.
type BenchClusterCmd struct {
	Size  bytesize.Size `default:"1GiB" help:"Size of the large host object (default ${default})." placeholder:"BYTES"`
	Small bytesize.Size `default:"4KiB" help:"Size of each small object (default ${default})." placeholder:"BYTES"`
	Count int           `default:"1000" help:"Small objects pulled (default ${default})." placeholder:"N"`
	// Streams is the daemons' chunks in flight per holder.
	Streams int `default:"0" help:"Reads a pull keeps in flight from one holder; 0: the daemon's default." placeholder:"N"`
	// ReadSize bounds one read of a pull (node.Config.ReadBytes).
	ReadSize bytesize.Size `name:"read-size" default:"0" help:"Most bytes one read of a pull covers (consecutive chunks read together); 0: the daemon's default." placeholder:"BYTES"`
	// Lanes is the daemons' UCX lanes (node.Config.Lanes).
	Lanes int `default:"0" help:"UCX workers each daemon serves and pulls with (0: one)." placeholder:"N"`
	// Read is how the reading daemon reads (node.Config.Read).
	Read string `default:"fetch" enum:"fetch,get" help:"How the daemons read each other: fetch (the holder sends; serve's default) or get (UCX GETs)." placeholder:"MODE"`
	JSON bool   `name:"json" help:"Print one JSON object: GB/s, p50/p99, ucx_perftest's figures and the ratios."`
	// CPUProfile, when set, is where the large get's CPU profile goes.
	CPUProfile string `name:"cpu-profile" help:"Write a CPU profile of the large get (both daemons run in this process) to FILE, for 'go tool pprof'." placeholder:"FILE" type:"path"`
	// EtcdDir is where the private etcd keeps its data.
	EtcdDir string `name:"etcd-dir" help:"Directory for the private etcd's data; default: a new one under /dev/shm when there is one (memory: etcd's fsyncs cost nothing, as in the tests), else under the system's temporary directory." placeholder:"DIR"`
}

// Help is the command's long description.
func (c *BenchClusterCmd) Help() string {
	return `Starts, on this machine, a private etcd (the etcd binary on PATH or at
$CUDAIPC_ETCD) and two daemons joined as a cluster over one link
(UCX_TLS=tcp and UCX_NET_DEVICES=lo unless set), puts on the first a
--size host object and --count objects of --small bytes, and gets each on
the second (each get pulls the object: directory lookup, pin, control
channel, UCX GETs, checksums, seal, advertise). It then runs ucx_perftest
on the same link as the floor: ucp_get (1 MiB gets, 8 in flight) for the
bandwidth and ucp_am_lat of --small bytes for UCX's own round trip, and
reports pull/perftest ratios. The private etcd keeps its data in memory
(/dev/shm) unless --etcd-dir says otherwise: with a disk, etcd's fsyncs
add to every first get (the directory writes of a pull). Figures of one run compare; runs on a loaded
machine differ.`
}

type benchClusterResult struct {
	UCXLibrary   string  `json:"ucx_library"`
	UCXVersion   string  `json:"ucx_version"`
	UCXTLS       string  `json:"ucx_tls"`
	UCXDevices   string  `json:"ucx_net_devices"`
	EtcdDir      string  `json:"etcd_dir"`
	LargeBytes   int64   `json:"large_bytes"`
	LargeSeconds float64 `json:"large_seconds"`
	LargeGBps    float64 `json:"large_GBps"`
	LargeEqual   bool    `json:"large_bytes_equal"`
	// LargeCPU is the CPU time (user and system) this process, both
	// daemons, took during the large get: on a loaded machine a steadier
	// figure than the bandwidth.
	LargeCPU   float64 `json:"large_cpu_seconds"`
	Streams    int     `json:"streams_per_holder,omitempty"`
	ReadBytes  int64   `json:"read_bytes,omitempty"`
	Lanes      int     `json:"lanes,omitempty"`
	Read       string  `json:"read"`
	SmallBytes int64   `json:"small_bytes"`
	SmallCount int     `json:"small_count"`
	SmallP50US float64 `json:"small_p50_us"`
	SmallP99US float64 `json:"small_p99_us"`
	SmallEqual bool    `json:"small_bytes_equal"`
	// SmallInline and SmallMirrored count the small gets whose object
	// came in the holder's answer (cluster.MaxInline) and whose lookup the
	// node's directory mirror answered (no etcd read).
	SmallInline   uint64 `json:"small_inline"`
	SmallMirrored uint64 `json:"small_mirrored"`
	// LocalP50US is the p50 of a get of the same small objects on the node
	// that holds them: the store's own get, the floor under a remote one.
	LocalP50US    float64 `json:"local_p50_us"`
	PerftestGBps  float64 `json:"perftest_ucp_get_GBps"`
	PerftestRTTUS float64 `json:"perftest_am_round_trip_us"`
	RatioLarge    float64 `json:"ratio_large_to_perftest"`
	RatioSmall    float64 `json:"ratio_small_p50_to_round_trip"`
	PerftestError string  `json:"perftest_error,omitempty"`
}

// Run measures and prints the result.
func (c *BenchClusterCmd) Run(e *Env) error {
	if c.Size <= 0 || c.Small <= 0 || c.Count < 1 || c.Streams < 0 || c.ReadSize < 0 || c.Lanes < 0 {
		return usagef("--size, --small and --count must be positive, --streams, --read-size and --lanes not negative")
	}
	if err := ucx.Available(); err != nil {
		return fmt.Errorf("bench cluster: UCX: %w (Debian/Ubuntu: apt-get install libucx0)", err)
	}
	for k, v := range map[string]string{"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"} {
		if os.Getenv(k) == "" {
			_ = os.Setenv(k, v)
		}
	}
	res := benchClusterResult{UCXTLS: os.Getenv("UCX_TLS"), UCXDevices: os.Getenv("UCX_NET_DEVICES"),
		Streams: c.Streams, ReadBytes: int64(c.ReadSize), Lanes: c.Lanes, Read: c.Read, LargeBytes: int64(c.Size), SmallBytes: int64(c.Small), SmallCount: c.Count, UCXLibrary: ucx.Library()}
	res.UCXVersion, _ = ucx.Version()
	progress := func(format string, args ...any) {
		if isTTY(e.Stderr) {
			fmt.Fprintf(e.Stderr, "bench cluster: "+format+"\n", args...)
		}
	}
	ctx, cancel := context.WithTimeout(e.Ctx, 30*time.Minute)
	defer cancel()
	a, b, stop, err := c.startCluster(ctx, e, &res, progress)
	defer stop()
	if err != nil {
		return err
	}
	if err := c.measureGets(ctx, a, b, &res, progress); err != nil {
		return err
	}
	a.stop()
	b.stop()
	progress("running ucx_perftest on the same link")
	perftestFloor(ctx, &res, int(c.Small))
	if c.JSON {
		return printJSON(e.Stdout, res)
	}
	c.print(e.Stdout, res)
	return nil
}

// startCluster starts a private etcd and the two daemons, a and b, joined
// as a cluster; stop (to call even when err is set) stops what started and
// removes their directories.
func (c *BenchClusterCmd) startCluster(ctx context.Context, e *Env, res *benchClusterResult, progress func(string, ...any)) (a, b *benchDaemon, stop func(), err error) {
	var stops []func()
	stop = func() {
		for i := len(stops) - 1; i >= 0; i-- {
			stops[i]()
		}
	}
	tmp, err := os.MkdirTemp("", "cudaipc-bench-cluster-")
	if err != nil {
		return nil, nil, stop, err
	}
	stops = append(stops, func() { os.RemoveAll(tmp) })
	etcdDir := c.EtcdDir
	if etcdDir == "" {
		base := ""
		if fi, err := os.Stat("/dev/shm"); err == nil && fi.IsDir() {
			base = "/dev/shm"
		}
		if etcdDir, err = os.MkdirTemp(base, "cudaipc-bench-etcd-"); err != nil {
			return nil, nil, stop, err
		}
		stops = append(stops, func() { os.RemoveAll(etcdDir) })
	}
	res.EtcdDir = etcdDir
	progress("starting etcd (data in %s)", etcdDir)
	etcd, err := startEtcd(ctx, etcdDir)
	if err != nil {
		return nil, nil, stop, fmt.Errorf("bench cluster: %w", err)
	}
	stops = append(stops, etcd.stop)
	key := make([]byte, 32)
	_, _ = rand.Read(key)
	sec, err := cluster.NewSecret(key)
	if err != nil {
		return nil, nil, stop, err
	}
	capacity := 2*int64(c.Size) + 2*int64(c.Count)*max(int64(c.Small), 64<<10) + 256<<20
	progress("starting two daemons")
	for _, d := range []struct {
		name string
		to   **benchDaemon
	}{{"a", &a}, {"b", &b}} {
		bd, err := startBenchDaemon(ctx, e, tmp, d.name, etcd.endpoint, sec, capacity, c.Streams, int64(c.ReadSize), c.Lanes, c.Read)
		if err != nil {
			return nil, nil, stop, err
		}
		stops = append(stops, bd.stop)
		*d.to = bd
	}
	return a, b, stop, nil
}

// measureGets puts the large object and the small ones on a and times
// their gets on b (pulls), then the small ones' gets on a (the floor).
func (c *BenchClusterCmd) measureGets(ctx context.Context, a, b *benchDaemon, res *benchClusterResult, progress func(string, ...any)) error {
	progress("putting %s and %d objects of %s on node a", c.Size, c.Count, c.Small)
	large, err := benchPutHost(ctx, a.c, "bench/large", int64(c.Size))
	if err != nil {
		return err
	}
	smalls := make([][]byte, c.Count)
	for i := range smalls {
		if smalls[i], err = benchPutHost(ctx, a.c, fmt.Sprintf("bench/small/%d", i), int64(c.Small)); err != nil {
			return err
		}
	}

	progress("getting the %s object on node b", c.Size)
	if err := c.getLarge(ctx, b, large, res); err != nil {
		return err
	}

	progress("getting %d objects of %s on node b", c.Count, c.Small)
	st0 := b.n.Stats()
	hits0, _ := b.n.Mirror().Stats()
	lat, equal, err := timeGets(ctx, b, "b", smalls)
	if err != nil {
		return err
	}
	res.SmallEqual = equal
	res.SmallP50US = float64(lat[len(lat)/2].Nanoseconds()) / 1e3
	res.SmallP99US = float64(lat[len(lat)*99/100].Nanoseconds()) / 1e3
	res.SmallInline = b.n.Stats().Inline - st0.Inline
	hits1, _ := b.n.Mirror().Stats()
	res.SmallMirrored = hits1 - hits0
	if lat, _, err = timeGets(ctx, a, "a", smalls); err != nil {
		return err
	}
	res.LocalP50US = float64(lat[len(lat)/2].Nanoseconds()) / 1e3
	return nil
}

// getLarge times the get of the large object on b (with the CPU profile
// --cpu-profile asks for) and checks its bytes.
func (c *BenchClusterCmd) getLarge(ctx context.Context, b *benchDaemon, want []byte, res *benchClusterResult) error {
	if c.CPUProfile != "" {
		f, err := os.Create(c.CPUProfile)
		if err != nil {
			return fmt.Errorf("bench cluster: --cpu-profile: %w", err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return fmt.Errorf("bench cluster: --cpu-profile: %w", err)
		}
	}
	t0, cpu0 := time.Now(), cpuTime()
	l, err := b.c.Get(ctx, "bench/large")
	res.LargeCPU = (cpuTime() - cpu0).Seconds()
	if c.CPUProfile != "" {
		pprof.StopCPUProfile()
	}
	if err != nil {
		return fmt.Errorf("bench cluster: get of the large object on node b: %w", err)
	}
	res.LargeSeconds = time.Since(t0).Seconds()
	res.LargeGBps = float64(c.Size) / res.LargeSeconds / 1e9
	res.LargeEqual = bytes.Equal(l.Bytes(), want)
	l.Release()
	return nil
}

// timeGets gets each of the small objects on d (named node) and returns the
// sorted latencies and whether every object read its bytes.
func timeGets(ctx context.Context, d *benchDaemon, node string, smalls [][]byte) ([]time.Duration, bool, error) {
	lat := make([]time.Duration, 0, len(smalls))
	equal := true
	for i := range smalls {
		t := time.Now()
		l, err := d.c.Get(ctx, fmt.Sprintf("bench/small/%d", i))
		if err != nil {
			return nil, false, fmt.Errorf("bench cluster: get of a small object on node %s: %w", node, err)
		}
		lat = append(lat, time.Since(t))
		equal = equal && bytes.Equal(l.Bytes(), smalls[i])
		l.Release()
	}
	slices.Sort(lat)
	return lat, equal, nil
}

// perftestFloor runs ucx_perftest on the link of res for the floors:
// ucp_get of 1 MiB, 8 in flight, for the bandwidth and ucp_am_lat of small
// bytes for the round trip; a failure is in res.PerftestError.
func perftestFloor(ctx context.Context, res *benchClusterResult, small int) {
	env := []string{"UCX_TLS=" + res.UCXTLS, "UCX_NET_DEVICES=" + res.UCXDevices}
	pt, err := ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_get", Size: 1 << 20, Iters: 2048, Warmup: 64, Outstanding: 8, Env: env})
	if err == nil {
		res.PerftestGBps = pt.BytesPerSec / 1e9
		res.RatioLarge = res.LargeGBps / res.PerftestGBps
		pt, err = ucxperf.Perftest(ctx, ucxperf.PerftestOptions{Test: "ucp_am_lat", Size: small, Iters: 2000, Warmup: 100, Env: env})
	}
	if err == nil {
		// ucx_perftest's latency is half a round trip.
		res.PerftestRTTUS = 2 * float64(pt.P50.Nanoseconds()) / 1e3
		res.RatioSmall = res.SmallP50US / res.PerftestRTTUS
	}
	if err != nil {
		res.PerftestError = err.Error()
	}
}

// print writes res as text.
func (c *BenchClusterCmd) print(w io.Writer, res benchClusterResult) {
	fmt.Fprintf(w, "link: UCX_TLS=%s UCX_NET_DEVICES=%s (two daemons on this machine, UCX %s from %s, reads: %s), etcd data in %s\n", res.UCXTLS, res.UCXDevices, res.UCXVersion, res.UCXLibrary, res.Read, res.EtcdDir)
	fmt.Fprintf(w, "%-34s %10.2f GB/s  (%.3f s, %.3f s of CPU, bytes equal: %v)\n", "get of a "+c.Size.String()+" object", res.LargeGBps, res.LargeSeconds, res.LargeCPU, res.LargeEqual)
	fmt.Fprintf(w, "%-34s p50 %8.1f µs  p99 %8.1f µs  (bytes equal: %v)\n", fmt.Sprintf("gets of %d objects of %s", c.Count, c.Small), res.SmallP50US, res.SmallP99US, res.SmallEqual)
	fmt.Fprintf(w, "%-34s %d read inline, %d looked up in the mirror (no etcd read)\n", "  of which", res.SmallInline, res.SmallMirrored)
	fmt.Fprintf(w, "%-34s p50 %8.1f µs  (the floor under a remote get)\n", "  the same gets on the holder", res.LocalP50US)
	if res.PerftestError != "" {
		fmt.Fprintf(w, "ucx_perftest: %s\n", res.PerftestError)
		return
	}
	fmt.Fprintf(w, "%-34s %10.2f GB/s  -> pull/perftest %.2fx\n", "ucx_perftest ucp_get 1 MiB x8", res.PerftestGBps, res.RatioLarge)
	fmt.Fprintf(w, "%-34s %10.1f µs    -> p50/round trip %.2fx\n", "ucx_perftest ucp_am_lat round trip", res.PerftestRTTUS, res.RatioSmall)
}

// cpuTime is the user and system CPU time this process has taken.
func cpuTime() time.Duration {
	var ru unix.Rusage
	if unix.Getrusage(unix.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func isTTY(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
	return err == nil
}

// benchPutHost puts a cluster-visible host object of random bytes and
// returns its bytes.
func benchPutHost(ctx context.Context, c *client.Client, name string, size int64) ([]byte, error) {
	o, err := c.Create(ctx, name, size, client.CreateOptions{Cluster: true})
	if err != nil {
		return nil, fmt.Errorf("bench cluster: create %s on node a: %w", name, err)
	}
	_, _ = rand.Read(o.Bytes())
	want := bytes.Clone(o.Bytes())
	if err := o.Seal(ctx); err != nil {
		return nil, fmt.Errorf("bench cluster: seal %s on node a: %w", name, err)
	}
	return want, nil
}

type benchDaemon struct {
	n     *node.Node
	st    *store.Store
	c     *client.Client
	done  chan struct{}
	close func()
}

func (d *benchDaemon) stop() {
	if d.close != nil {
		d.close()
		d.close = nil
	}
}

func startBenchDaemon(ctx context.Context, e *Env, dir, name, endpoint string, sec cluster.Secret, capacity int64, streams int, readBytes int64, lanes int, read string) (*benchDaemon, error) {
	// The daemons' warnings and errors only: their info lines would bury
	// the progress.
	log := slog.New(slog.NewTextHandler(e.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn})).With("node", name)
	sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	n, err := node.Start(sctx, node.Config{
		Directory: etcddir.Config{Endpoints: []string{endpoint}, Node: name, Secret: sec, Prefix: "/cudaipc-bench/"},
		Listen:    "127.0.0.1:0", Logger: log, StreamsPerHolder: streams, ReadBytes: readBytes, Lanes: lanes,
		Read: ucxtransport.ReadMode(read),
	})
	if err != nil {
		return nil, fmt.Errorf("bench cluster: start node %s: %w", name, err)
	}
	st, err := store.New(store.Config{Backend: "host", Capacity: capacity, Cluster: n, Logger: log})
	if err != nil {
		n.Close()
		return nil, fmt.Errorf("bench cluster: store of node %s: %w", name, err)
	}
	if err := n.Attach(sctx, st); err != nil {
		st.Close()
		n.Close()
		return nil, fmt.Errorf("bench cluster: node %s: %w", name, err)
	}
	sock := filepath.Join(dir, name+".sock")
	lctx, stopServe := context.WithCancel(context.Background())
	d := &benchDaemon{n: n, st: st, done: make(chan struct{})}
	go func() { _ = st.ListenAndServe(lctx, sock); close(d.done) }()
	d.close = func() {
		if d.c != nil {
			d.c.Close()
		}
		stopServe()
		<-d.done
		st.Close()
		n.Close()
	}
	for {
		if d.c, err = client.Dial(sctx, sock); err == nil {
			return d, nil
		}
		if sctx.Err() != nil {
			d.stop()
			return nil, fmt.Errorf("bench cluster: node %s's socket: %w", name, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// benchEtcd is a private etcd member on loopback.
type benchEtcd struct {
	endpoint string
	cmd      *exec.Cmd
	exited   chan struct{}
}

func (s *benchEtcd) stop() {
	_ = s.cmd.Process.Kill()
	<-s.exited
}

// startEtcd runs the etcd binary ($CUDAIPC_ETCD, or etcd on PATH) on free
// loopback ports with its data under dir.
func startEtcd(ctx context.Context, dir string) (*benchEtcd, error) {
	bin := os.Getenv("CUDAIPC_ETCD")
	if bin == "" {
		p, err := exec.LookPath("etcd")
		if err != nil {
			return nil, errors.New("no etcd binary to run a private etcd: install etcd-server (Debian/Ubuntu) or set CUDAIPC_ETCD to an etcd binary")
		}
		bin = p
	}
	ports := make([]int, 2)
	for i := range ports {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		ports[i] = ln.Addr().(*net.TCPAddr).Port
		ln.Close()
	}
	client := fmt.Sprintf("http://127.0.0.1:%d", ports[0])
	peer := fmt.Sprintf("http://127.0.0.1:%d", ports[1])
	logf, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		return nil, err
	}
	defer logf.Close()
	cmd := exec.Command(bin, "--name", "bench", "--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "bench="+peer, "--log-level", "warn")
	cmd.Stdout, cmd.Stderr = logf, logf
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start etcd (%s): %w", bin, err)
	}
	s := &benchEtcd{endpoint: client, cmd: cmd, exited: make(chan struct{})}
	go func() { _ = cmd.Wait(); close(s.exited) }()
	hc := http.Client{Timeout: time.Second}
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		select {
		case <-s.exited:
			b, _ := os.ReadFile(filepath.Join(dir, "etcd.log"))
			return nil, fmt.Errorf("etcd (%s) exited at start: %s", bin, strings.TrimSpace(lastLines(string(b), 3)))
		default:
		}
		if r, err := hc.Get(client + "/health"); err == nil {
			body, _ := io.ReadAll(r.Body)
			r.Body.Close()
			if r.StatusCode == 200 && strings.Contains(string(body), "true") {
				return s, nil
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	s.stop()
	return nil, fmt.Errorf("etcd (%s) not healthy within 20s", bin)
}

func lastLines(s string, n int) string {
	lines := strings.Split(strings.TrimSpace(s), "\n")
	return strings.Join(lines[max(0, len(lines)-n):], "\n")
}
