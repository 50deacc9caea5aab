package ucxperf

import (
	"testing"
	"time"
)

func TestParsePerftest(t *testing.T) {
	out := []byte("iterations,50.0_percentile_lat,avg_lat,overall_lat,avg_bw,overall_bw,avg_mr,overall_mr\n3000,2830.914,2589.539,3146.674,1.51,1.24,386,318\n")
	r, err := parsePerftest(out)
	if err != nil {
		t.Fatal(err)
	}
	if r.Iters != 3000 || r.P50 != 2830914*time.Nanosecond || r.BytesPerSec != 1.24*(1<<20) || r.MsgRate != 318 {
		t.Fatalf("parsed %+v", r)
	}
	if _, err := parsePerftest([]byte("UCX ERROR something\n")); err == nil {
		t.Fatal("parsed a result from no result line")
	}
}

func TestSummarize(t *testing.T) {
	d := make([]time.Duration, 100)
	for i := range d {
		d[i] = time.Duration(100-i) * time.Microsecond
	}
	l := summarize(d)
	if l.N != 100 || l.P50 != 51*time.Microsecond || l.P99 != 100*time.Microsecond {
		t.Fatalf("summarize: %+v", l)
	}
}
