package diag

import (
	"bytes"
	"encoding/json"
	"errors"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/cudaipc/cudaipc/internal/seeddata"
)

func TestRankIndex(t *testing.T) {
	for _, c := range []struct{ n, pct, want int }{
		{1, 50, 0}, {1, 99, 0}, {2, 50, 0}, {3, 50, 1}, {10, 99, 9},
		{100, 50, 49}, {100, 99, 98}, {200, 50, 99}, {200, 99, 197}, {20, 99, 19}, {0, 50, 0},
	} {
		if got := rankIndex(c.n, c.pct); got != c.want {
			t.Errorf("rankIndex(%d, %d) = %d, want %d", c.n, c.pct, got, c.want)
		}
	}
}

func TestLatencyStat(t *testing.T) {
	d := make([]time.Duration, 200)
	for i := range d {
		d[i] = time.Duration(i+1) * time.Microsecond
	}
	rand.Shuffle(len(d), func(i, j int) { d[i], d[j] = d[j], d[i] })
	in := slices.Clone(d)
	s := latencyStat(d)
	if s.Unit != "us" || s.P50 != 100 || s.P99 != 198 || s.N != 200 {
		t.Fatalf("%+v", s)
	}
	if !slices.Equal(d, in) {
		t.Fatal("latencyStat reordered its argument")
	}
	if s := latencyStat(nil); s.N != 0 || s.Unit != "us" {
		t.Fatalf("empty: %+v", s)
	}
}

func TestBandwidthStat(t *testing.T) {
	d := []time.Duration{time.Millisecond, time.Millisecond, time.Millisecond, 2 * time.Millisecond}
	s := bandwidthStat(2e9, d)
	if s.Unit != "GB/s" || s.P50 != 2000 || s.P99 != 1000 || s.N != 4 {
		t.Fatalf("%+v", s)
	}
	if s := bandwidthStat(1, []time.Duration{0}); s.P50 != 0 {
		t.Fatalf("zero duration: %+v", s)
	}
}

func sampleReport() *ipcBenchReport {
	r := &ipcBenchReport{
		Tool: "cudaipc-go", Device: "NVIDIA H200", GPUs: 2, Size: 1 << 30, Iters: 200, BWIters: 20,
		Staging: "via a memfd",
		Metrics: map[string]ipcStat{
			"export_first":   {Unit: "us", P50: 20.1, P99: 25, N: 200},
			"open_cold_1mib": {Unit: "us", P50: 41.25, P99: 83, N: 200},
			"d2d_local":      {Unit: "GB/s", P50: 2130, P99: 2100, N: 20, Ref: "d2d_local"},
			"ipc_read":       {Unit: "GB/s", P50: 2120, P99: 2090, N: 20, Ref: "d2d_local"},
			"host_staged":    {Unit: "GB/s", P50: 21.3, P99: 20, N: 20, Ref: "d2d_local"},
			"peer_local":     {Unit: "GB/s", P50: 400, P99: 390, N: 20, Ref: "peer_local"},
			"peer_ipc":       {Unit: "GB/s", P50: 396, P99: 390, N: 20, Ref: "peer_local"},
		},
	}
	r.setRatios()
	return r
}

func TestSetRatios(t *testing.T) {
	r := sampleReport()
	for k, want := range map[string]float64{"d2d_local": 1, "ipc_read": 2120.0 / 2130, "host_staged": 0.01, "peer_ipc": 0.99, "export_first": 0} {
		if got := r.Metrics[k].Ratio; got != want {
			t.Errorf("%s ratio %v, want %v", k, got, want)
		}
	}
}

// TestIPCReportJSON pins the shape scripts/bench/compare.py reads, which the
// C and Python programs print too.
func TestIPCReportJSON(t *testing.T) {
	b, err := json.Marshal(sampleReport())
	if err != nil {
		t.Fatal(err)
	}
	var doc map[string]any
	if err := json.Unmarshal(b, &doc); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"tool", "device", "gpus", "size", "iters", "bw_iters", "staging", "metrics"} {
		if _, ok := doc[k]; !ok {
			t.Errorf("no %q in %s", k, b)
		}
	}
	metrics := doc["metrics"].(map[string]any)
	known := map[string]bool{}
	for _, m := range ipcMetrics {
		if known[m.Key] {
			t.Errorf("metric %s listed twice", m.Key)
		}
		known[m.Key] = true
	}
	for k, v := range metrics {
		if !known[k] {
			t.Errorf("metric %s is not in ipcMetrics", k)
		}
		m := v.(map[string]any)
		for _, f := range []string{"unit", "p50", "p99", "n"} {
			if _, ok := m[f]; !ok {
				t.Errorf("%s lacks %q", k, f)
			}
		}
		if m["unit"] == "GB/s" {
			if _, ok := m["ratio"]; !ok {
				t.Errorf("bandwidth %s lacks its ratio", k)
			}
		}
	}
}

func TestIPCTable(t *testing.T) {
	var out bytes.Buffer
	if err := writeIPCTable(&out, sampleReport()); err != nil {
		t.Fatal(err)
	}
	s := out.String()
	for _, want := range []string{
		"cudaipc-go: NVIDIA H200, 2 GPU(s), large = 1 GiB, 200 repetitions a latency, 20 a bandwidth",
		"export_first", "41.2", "2130", "0.995x d2d_local", "0.99x peer_local", "host_staged: via a memfd",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("table lacks %q:\n%s", want, s)
		}
	}
	// Rows follow ipcMetrics; absent metrics are not printed.
	if strings.Index(s, "export_first") > strings.Index(s, "open_cold_1mib") || strings.Index(s, "d2d_local ") > strings.Index(s, "ipc_read") {
		t.Errorf("rows out of order:\n%s", s)
	}
	if strings.Contains(s, "event_open") {
		t.Errorf("printed a row that was not measured:\n%s", s)
	}
	lines := strings.Split(s, "\n")
	var lat, bw string
	for _, l := range lines {
		if strings.HasPrefix(l, "latency") {
			lat = l
		}
		if strings.HasPrefix(strings.TrimSpace(l), "open_cold_1mib") {
			bw = l
		}
	}
	if lat == "" || bw == "" || endColumn(lat, "p50 µs") != endColumn(bw, "41.2") {
		t.Errorf("p50 column not right-aligned:\n%s", s)
	}
}

// endColumn returns the column (in runes) where s ends in line.
func endColumn(line, s string) int {
	i := strings.Index(line, s)
	if i < 0 {
		return -1
	}
	return utf8.RuneCountInString(line[:i+len(s)])
}

func TestFormatNum(t *testing.T) {
	for v, want := range map[float64]string{0: "0", 2130.4: "2130", 41.25: "41.2", 2.6: "2.60", 0.3: "0.3", 0.125: "0.125"} {
		if got := formatNum(v); got != want {
			t.Errorf("formatNum(%v) = %q, want %q", v, got, want)
		}
	}
}

func TestBenchIPCValidate(t *testing.T) {
	ok := BenchIPCCmd{Size: 1 << 20, Iters: 1, BWIters: 1}
	if err := ok.validate(); err != nil {
		t.Fatal(err)
	}
	for _, c := range []BenchIPCCmd{{Size: 1<<20 - 1, Iters: 1, BWIters: 1}, {Size: 1 << 20, Iters: 0, BWIters: 1}, {Size: 1 << 20, Iters: 1, BWIters: 0}} {
		var ue *UsageError
		if err := c.validate(); !errors.As(err, &ue) {
			t.Errorf("%+v: %v, want a *UsageError", c, err)
		}
	}
}

func TestParallelCopy(t *testing.T) {
	for _, n := range []int{0, 1, 7, 4096, 1<<20 + 13} {
		src := seeddata.Bytes(uint64(n), n)
		dst := make([]byte, n)
		parallelCopy(dst, src)
		if !bytes.Equal(dst, src) {
			t.Fatalf("parallelCopy of %d bytes differs", n)
		}
	}
}

func TestPercentile(t *testing.T) {
	d := []time.Duration{1, 2, 3, 4, 5, 6, 7, 8, 9, 10}
	for pct, want := range map[int]time.Duration{50: 5, 90: 9, 99: 10, 100: 10, 1: 1} {
		if got := percentile(d, pct); got != want {
			t.Errorf("percentile(1..10, %d) = %d, want %d", pct, got, want)
		}
	}
	if percentile(nil, 50) != 0 {
		t.Error("percentile of nothing")
	}
}
