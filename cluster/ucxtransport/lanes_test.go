package ucxtransport

import (
	"bytes"
	"encoding/binary"
	"errors"
	"os"
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

// TestLanesAddress: a node of one lane publishes its worker address
// envelope alone; one of several, every lane's, which decode to the same
// addresses; malformed ones are ErrMalformed.
func TestLanesAddress(t *testing.T) {
	one := lanesOf(t, 1)
	var a ucx.WorkerAddress
	if err := a.UnmarshalBinary(one); err != nil {
		t.Fatalf("a node of one lane: %v", err)
	}
	three := lanesOf(t, 3)
	addrs, err := unmarshalLanes(three)
	if err != nil || len(addrs) != 3 {
		t.Fatalf("three lanes: %d addresses, %v", len(addrs), err)
	}
	again, err := marshalLanes(addrs)
	if err != nil || !bytes.Equal(again, three) {
		t.Fatalf("three lanes encoded again differ (%v)", err)
	}
	if _, err := NewWith("too-many", Options{Lanes: MaxLanes + 1}); err == nil {
		t.Fatal("more than MaxLanes lanes accepted")
	}
	count := func(n byte) []byte { b := bytes.Clone(three); b[4] = n; return b }
	grown := func(d uint32) []byte {
		b := bytes.Clone(three)
		binary.LittleEndian.PutUint32(b[5:], binary.LittleEndian.Uint32(b[5:])+d)
		return b
	}
	flipped := bytes.Clone(three)
	flipped[len(flipped)/2] ^= 0x10
	for name, b := range map[string][]byte{
		"magic alone":     three[:4],
		"one lane":        count(1),
		"too many lanes":  count(MaxLanes + 1),
		"more lanes":      count(4),
		"truncated":       three[:len(three)-1],
		"trailing bytes":  append(bytes.Clone(three), 0),
		"length too long": grown(1 << 20),
		"length off":      grown(1),
		"a lane corrupt":  flipped,
	} {
		if _, err := unmarshalLanes(b); !errors.Is(err, ucx.ErrMalformed) {
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
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		addrs, err := unmarshalLanes(b)
		if err != nil {
			if !errors.Is(err, ucx.ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		if len(addrs) < 1 || len(addrs) > MaxLanes {
			t.Fatalf("%d addresses", len(addrs))
		}
		again, err := marshalLanes(addrs)
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("encoded again: %v (%x vs %x)", err, again, b)
		}
	})
}
