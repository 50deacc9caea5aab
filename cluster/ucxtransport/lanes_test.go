package ucxtransport

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// lanesOf is the address of a transport of n lanes, closed with the test.
func lanesOf(t testing.TB, n int) []byte {
	t.Helper()
	if err := ucx.Available(); err != nil {
		if os.Getenv("CUDAIPC_REQUIRE_UCX") == "1" {
			t.Fatal(err)
		}
		t.Skip(err)
	}
	tr, err := NewWith("lanes-test", Options{Lanes: n})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tr.Close() })
	return tr.WorkerAddress()
}

// TestLanesAddress: a node publishes every lane's worker address and that
// it answers fetches; the addresses nodes of earlier versions published (a
// worker address envelope alone, magicLanes) decode to GET-only peers;
// malformed ones are ErrMalformed.
func TestLanesAddress(t *testing.T) {
	one, err := parsePeerAddress(lanesOf(t, 1))
	if err != nil || len(one.lanes) != 1 || !one.fetch || one.get {
		t.Fatalf("a node of one lane: %d lanes, fetch %v, get %v, %v", len(one.lanes), one.fetch, one.get, err)
	}
	tr, err := NewWith("lanes-get", Options{Read: ReadGet})
	if err != nil {
		t.Fatal(err)
	}
	defer tr.Close()
	if pa, err := parsePeerAddress(tr.WorkerAddress()); err != nil || !pa.fetch || !pa.get {
		t.Fatalf("a node reading with GETs: fetch %v, get %v, %v; want both", pa.fetch, pa.get, err)
	}
	three := lanesOf(t, 3)
	pa, err := parsePeerAddress(three)
	if err != nil || len(pa.lanes) != 3 || !pa.fetch {
		t.Fatalf("three lanes: %d addresses, fetch %v, %v", len(pa.lanes), pa.fetch, err)
	}
	again, err := pa.marshal()
	if err != nil || !bytes.Equal(again, three) {
		t.Fatalf("three lanes encoded again differ (%v)", err)
	}
	for _, old := range []peerAddress{{lanes: pa.lanes[:1], get: true}, {lanes: pa.lanes, get: true}} {
		b, err := old.marshal()
		if err != nil {
			t.Fatal(err)
		}
		back, err := parsePeerAddress(b)
		if err != nil || back.fetch || !back.get || len(back.lanes) != len(old.lanes) {
			t.Fatalf("an earlier node's address of %d lanes: %d lanes, fetch %v, %v", len(old.lanes), len(back.lanes), back.fetch, err)
		}
	}
	// A node that reads with fetches cannot read a peer that answers only
	// GETs, and says what to do; one that reads with GETs can.
	oldAddr, err := peerAddress{lanes: pa.lanes[:1], get: true}.marshal()
	if err != nil {
		t.Fatal(err)
	}
	fetcher, err := NewWith("lanes-fetch", Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer fetcher.Close()
	if _, err := fetcher.Connect(context.Background(), oldAddr); err == nil || !strings.Contains(err.Error(), `experimental-cluster-read = "get"`) {
		t.Errorf("a fetching node connecting to a GET-only peer: %v", err)
	}
	if ep, err := tr.Connect(context.Background(), oldAddr); err != nil {
		t.Errorf("a node reading with GETs connecting to a GET-only peer: %v", err)
	} else {
		ep.Close()
	}
	if _, err := NewWith("too-many", Options{Lanes: MaxLanes + 1}); err == nil {
		t.Fatal("more than MaxLanes lanes accepted")
	}
	count := func(n byte) []byte { b := bytes.Clone(three); b[5] = n; return b }
	grown := func(d uint32) []byte {
		b := bytes.Clone(three)
		binary.LittleEndian.PutUint32(b[6:], binary.LittleEndian.Uint32(b[6:])+d)
		return b
	}
	flags := bytes.Clone(three)
	flags[4] = 0x80
	flipped := bytes.Clone(three)
	flipped[len(flipped)/2] ^= 0x10
	for name, b := range map[string][]byte{
		"magic alone":     three[:4],
		"no count":        three[:5],
		"unknown flags":   flags,
		"no lane":         count(0),
		"too many lanes":  count(MaxLanes + 1),
		"more lanes":      count(4),
		"truncated":       three[:len(three)-1],
		"trailing bytes":  append(bytes.Clone(three), 0),
		"length too long": grown(1 << 20),
		"length off":      grown(1),
		"a lane corrupt":  flipped,
	} {
		if _, err := parsePeerAddress(b); !errors.Is(err, ucx.ErrMalformed) {
			t.Errorf("%s: %v, want ErrMalformed", name, err)
		}
	}
}

// FuzzLanesAddress: whatever a peer sends as its address decodes to a
// bounded list of checked addresses, which encode back to the same bytes,
// or to an ErrMalformed error, never a crash.
func FuzzLanesAddress(f *testing.F) {
	if ucx.Available() == nil {
		if tr, err := NewWith("fuzz-seed", Options{Lanes: 2}); err == nil {
			f.Add(tr.WorkerAddress())
			tr.Close()
		}
	}
	f.Add([]byte("ucLN\x02\x00\x00\x00\x00"))
	f.Add([]byte("ucFT\x00\x01\x00\x00\x00\x00"))
	f.Add([]byte("ucFT\x01\x02\x00\x00\x00\x00"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		pa, err := parsePeerAddress(b)
		if err != nil {
			if !errors.Is(err, ucx.ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		if len(pa.lanes) < 1 || len(pa.lanes) > MaxLanes {
			t.Fatalf("%d addresses", len(pa.lanes))
		}
		again, err := pa.marshal()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("encoded again: %v (%x vs %x)", err, again, b)
		}
	})
}

// FuzzWindowKey: whatever a peer hands out as an exposure's key decodes to
// a token and a checked region key, or to an ErrMalformed error, never a
// crash; a window key of a real region decodes to its token and region.
func FuzzWindowKey(f *testing.F) {
	if ucx.Available() == nil {
		if tr, err := NewWith("fuzz-window", Options{}); err == nil {
			mem := make([]byte, 1<<16)
			if r, err := tr.Register(mem); err == nil {
				if key, closeWindow, err := r.Window(4096, 8192); err == nil {
					f.Add(key)
					closeWindow()
				}
				f.Add(r.Key())
				r.Close()
			}
			tr.Close()
		}
	}
	f.Add([]byte("ucWK"))
	f.Add(append([]byte("ucWK"), make([]byte, 20)...))
	f.Fuzz(func(t *testing.T, b []byte) {
		rk, tok, window, err := parseKey(b)
		if err != nil {
			if !errors.Is(err, ucx.ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		again, err := rk.MarshalBinary()
		if err != nil {
			t.Fatalf("a decoded region key does not encode: %v", err)
		}
		want := again
		if window {
			want = append(append([]byte("ucWK"), tok[:]...), again...)
		}
		if !bytes.Equal(want, b) {
			t.Fatalf("decoded and encoded again to %x, from %x", want, b)
		}
	})
}
