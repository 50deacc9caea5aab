// Package ucxperf measures the UCX data plane: GET bandwidth and round
// trips through transport/ucx, and the same operations through UCX's own
// ucx_perftest (package ucx-utils) as the floor to compare with, on the
// same link in the same run. The cluster benchmark and transport/ucx's Go
// benchmarks use it.
package ucxperf

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// Latency is the distribution of a series of round trips.
type Latency struct {
	N        int
	P50, P99 time.Duration
	Mean     time.Duration
}

func (l Latency) String() string {
	return fmt.Sprintf("p50 %v p99 %v mean %v (n=%d)", l.P50, l.P99, l.Mean, l.N)
}

func summarize(d []time.Duration) Latency {
	if len(d) == 0 {
		return Latency{}
	}
	slices.Sort(d)
	var sum time.Duration
	for _, x := range d {
		sum += x
	}
	at := func(q float64) time.Duration { return d[min(len(d)-1, int(q*float64(len(d))))] }
	return Latency{N: len(d), P50: at(0.50), P99: at(0.99), Mean: sum / time.Duration(len(d))}
}

// GetLatency times n Gets of size bytes each, one at a time, at random
// size-aligned offsets of key's region (one chunk: a round trip each).
func GetLatency(ctx context.Context, ep *ucx.Endpoint, key *ucx.RemoteKey, size, n int) (Latency, error) {
	k := key.Key()
	if uint64(size) > k.Len || size <= 0 {
		return Latency{}, fmt.Errorf("ucxperf: %d-byte reads from a %d-byte region", size, k.Len)
	}
	slots := int(k.Len / uint64(size))
	dst := make([]byte, size)
	rng := rand.New(rand.NewPCG(uint64(size), uint64(n)))
	d := make([]time.Duration, 0, n)
	for range n {
		addr := k.Addr + uint64(rng.IntN(slots)*size)
		start := time.Now()
		if err := ucx.GetWith(ctx, ep, key, addr, dst, ucx.GetOptions{Chunk: size, Depth: 1}); err != nil {
			return Latency{}, err
		}
		d = append(d, time.Since(start))
	}
	return summarize(d), nil
}

// GetBandwidth reads len(dst) bytes from the start of key's region into dst
// rounds times with GetWith and o, and returns the best round's rate in
// bytes per second with every round's.
func GetBandwidth(ctx context.Context, ep *ucx.Endpoint, key *ucx.RemoteKey, dst []byte, o ucx.GetOptions, rounds int) (best float64, all []float64, err error) {
	for range rounds {
		start := time.Now()
		if err := ucx.GetWith(ctx, ep, key, key.Key().Addr, dst, o); err != nil {
			return 0, nil, err
		}
		r := float64(len(dst)) / time.Since(start).Seconds()
		all = append(all, r)
		best = max(best, r)
	}
	return best, all, nil
}

// Rates summarizes repeated bandwidth measurements, in bytes per second.
type Rates struct {
	Best, Median float64
	All          []float64
}

func rates(all []float64) Rates {
	if len(all) == 0 {
		return Rates{}
	}
	s := slices.Clone(all)
	slices.Sort(s)
	return Rates{Best: s[len(s)-1], Median: s[len(s)/2], All: all}
}

// Comparison is our GET bandwidth next to ucx_perftest's on the same link,
// measured in alternation so that both see the same load.
type Comparison struct {
	Ours, Floor Rates
}

// Ratio is our best rate over the floor's best.
func (c Comparison) Ratio() float64 { return c.Ours.Best / c.Floor.Best }

// CompareBandwidth alternates rounds of reading len(dst) bytes from the
// start of key's region (GetWith with o) with rounds of ucx_perftest run
// with p, rounds times each. On a shared machine, best-of and alternation
// keep the two comparable; the medians show the spread.
func CompareBandwidth(ctx context.Context, ep *ucx.Endpoint, key *ucx.RemoteKey, dst []byte, o ucx.GetOptions, p PerftestOptions, rounds int) (Comparison, error) {
	var ours, floor []float64
	for range rounds {
		_, r, err := GetBandwidth(ctx, ep, key, dst, o, 1)
		if err != nil {
			return Comparison{}, err
		}
		ours = append(ours, r...)
		f, err := Perftest(ctx, p)
		if err != nil {
			return Comparison{}, err
		}
		floor = append(floor, f.BytesPerSec)
	}
	return Comparison{Ours: rates(ours), Floor: rates(floor)}, nil
}

// PerftestOptions describe one ucx_perftest run between a server and a
// client process on 127.0.0.1.
type PerftestOptions struct {
	// Test is the -t test; empty means "ucp_get". "ucp_am_lat" is UCX's own
	// message round trip, with both sides polling.
	Test string
	// Size is the bytes of one get (-s).
	Size int
	// Iters and Warmup are -n and -w.
	Iters, Warmup int
	// Outstanding is -O, the gets in flight in bandwidth mode; 0 leaves
	// ucx_perftest's default.
	Outstanding int
	// Env is added to both processes' environment, e.g. UCX_TLS=tcp and
	// UCX_NET_DEVICES=lo to compare with a tcp run.
	Env []string
	// Binary is the ucx_perftest to run; empty means "ucx_perftest" on PATH.
	Binary string
}

// PerftestResult is what ucx_perftest reported for the whole run.
//
// Mind what its ucp_get measures over transports that emulate GET with
// messages (tcp, shared memory): its responder progresses its worker only
// between 1 ms polls of its control socket (perftest.c sock_io), so each
// get waits up to a millisecond for the responder: about 1 ms per get
// whatever the link. Over RDMA (rc, dc) the responder is not involved.
// ucp_am_lat has both sides polling; its latency is one way, half a round
// trip.
type PerftestResult struct {
	Iters       int
	P50         time.Duration // the median latency ucx_perftest prints
	Avg         time.Duration
	BytesPerSec float64 // overall bandwidth
	MsgRate     float64 // overall messages a second
}

// ErrNoPerftest says that ucx_perftest is not installed (Debian/Ubuntu:
// ucx-utils).
var ErrNoPerftest = errors.New("ucxperf: ucx_perftest not found: install ucx-utils (Debian/Ubuntu)")

// Perftest runs ucx_perftest (by default -t ucp_get) as a server and a
// client on 127.0.0.1 and parses the client's final line. Both processes end with
// ctx.
func Perftest(ctx context.Context, o PerftestOptions) (PerftestResult, error) {
	bin := o.Binary
	if bin == "" {
		p, err := exec.LookPath("ucx_perftest")
		if err != nil {
			return PerftestResult{}, ErrNoPerftest
		}
		bin = p
	}
	port, err := freePort()
	if err != nil {
		return PerftestResult{}, err
	}
	env := append(os.Environ(), o.Env...)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	srv := exec.CommandContext(ctx, bin, "-p", strconv.Itoa(port))
	srv.Env = env
	var srvOut bytes.Buffer
	srv.Stdout, srv.Stderr = &srvOut, &srvOut
	if err := srv.Start(); err != nil {
		return PerftestResult{}, err
	}
	defer func() { cancel(); _ = srv.Wait() }()
	test := o.Test
	if test == "" {
		test = "ucp_get"
	}
	args := []string{"127.0.0.1", "-p", strconv.Itoa(port), "-t", test, "-s", strconv.Itoa(o.Size),
		"-n", strconv.Itoa(o.Iters), "-w", strconv.Itoa(o.Warmup), "-f", "-v"}
	if o.Outstanding > 0 {
		args = append(args, "-O", strconv.Itoa(o.Outstanding))
	}
	// The client fails at once while the server does not listen yet: retry
	// for a bounded time.
	deadline := time.Now().Add(10 * time.Second)
	for {
		cli := exec.CommandContext(ctx, bin, args...)
		cli.Env = env
		out, err := cli.CombinedOutput()
		if err == nil {
			return parsePerftest(out)
		}
		if !bytes.Contains(out, []byte("Connection refused")) || time.Now().After(deadline) || ctx.Err() != nil {
			cancel()
			_ = srv.Wait() // the server's output is complete only now
			return PerftestResult{}, fmt.Errorf("ucx_perftest %s: %v\n%s\nserver:\n%s", strings.Join(args, " "), err, out, srvOut.String())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// parsePerftest reads the CSV line of ucx_perftest -f -v:
// iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr
// with latencies in microseconds and bandwidths in MB/s (2^20 bytes).
func parsePerftest(out []byte) (PerftestResult, error) {
	sc := bufio.NewScanner(bytes.NewReader(out))
	for sc.Scan() {
		f := strings.Split(strings.TrimSpace(sc.Text()), ",")
		if len(f) != 8 {
			continue
		}
		n, err := strconv.Atoi(f[0])
		if err != nil {
			continue
		}
		v := make([]float64, 8)
		for i := 1; i < 8; i++ {
			if v[i], err = strconv.ParseFloat(f[i], 64); err != nil {
				return PerftestResult{}, fmt.Errorf("ucx_perftest line %q: %v", sc.Text(), err)
			}
		}
		us := func(x float64) time.Duration { return time.Duration(x * float64(time.Microsecond)) }
		return PerftestResult{Iters: n, P50: us(v[1]), Avg: us(v[2]), BytesPerSec: v[5] * (1 << 20), MsgRate: v[7]}, nil
	}
	return PerftestResult{}, fmt.Errorf("no result line in ucx_perftest's output:\n%s", out)
}
