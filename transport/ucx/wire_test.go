package ucx_test

import (
	"bytes"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/cudaipc/cudaipc/transport/ucx"
)

// handRkey is a packed rkey laid out as ucp_rkey_pack does: domains 0 and 2,
// host memory, keys of 3 and 0 bytes, then a device and one distance.
func handRkey() []byte {
	b := binary.LittleEndian.AppendUint64(nil, 0b101)
	b = append(b, 0)          // UCS_MEMORY_TYPE_HOST
	b = append(b, 3, 1, 2, 3) // domain 0
	b = append(b, 0)          // domain 2
	b = append(b, 7, 7, 1, 2) // sys_dev 7, distance to device 7
	return b
}

func TestRegionKeyRoundTrip(t *testing.T) {
	k := ucx.RegionKey{Addr: 0x7f0012345000, Len: 1 << 30, Rkey: handRkey()}
	b, err := k.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	var got ucx.RegionKey
	if err := got.UnmarshalBinary(b); err != nil {
		t.Fatal(err)
	}
	if got.Addr != k.Addr || got.Len != k.Len || !bytes.Equal(got.Rkey, k.Rkey) {
		t.Fatalf("round trip gave %+v, want %+v", got, k)
	}
	for i := range b {
		bad := append([]byte(nil), b...)
		bad[i]++
		if err := got.UnmarshalBinary(bad); !errors.Is(err, ucx.ErrMalformed) {
			t.Fatalf("key with byte %d changed: %v", i, err)
		}
	}
	var addr ucx.WorkerAddress
	if err := addr.UnmarshalBinary(b); !errors.Is(err, ucx.ErrMalformed) {
		t.Fatalf("a region key decoded as a worker address: %v", err)
	}
}

func TestRegionKeyContains(t *testing.T) {
	k := ucx.RegionKey{Addr: 1000, Len: 100}
	for _, c := range []struct {
		addr, n uint64
		want    bool
	}{{1000, 100, true}, {1000, 0, true}, {1100, 0, true}, {1099, 1, true}, {999, 1, false}, {1099, 2, false}, {1101, 0, false}, {1050, ^uint64(0), false}} {
		if got := k.Contains(c.addr, c.n); got != c.want {
			t.Errorf("Contains(%d, %d) = %v, want %v", c.addr, c.n, got, c.want)
		}
	}
}

// FuzzRegionKey feeds arbitrary bytes to the decoder of region keys that
// peers publish: it never panics, and what it accepts re-encodes to the
// same bytes.
func FuzzRegionKey(f *testing.F) {
	good, _ := ucx.RegionKey{Addr: 4096, Len: 4096, Rkey: handRkey()}.MarshalBinary()
	f.Add(good)
	f.Add(good[:len(good)-1])
	f.Add([]byte("ucRK"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var k ucx.RegionKey
		if err := k.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ucx.ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		again, err := k.MarshalBinary()
		if err != nil {
			t.Fatalf("an accepted key does not re-encode: %v", err)
		}
		if !bytes.Equal(again, b) {
			t.Fatal("an accepted key re-encodes to other bytes")
		}
	})
}

// FuzzRkey feeds arbitrary packed rkeys to the layout check: it never
// panics and never accepts a key whose domains run past its end.
func FuzzRkey(f *testing.F) {
	f.Add(handRkey())
	f.Add(handRkey()[:12])
	f.Add(append(binary.LittleEndian.AppendUint64(nil, 1), 0, 200))
	f.Fuzz(func(t *testing.T, rkey []byte) {
		k := ucx.RegionKey{Addr: 4096, Len: 4096, Rkey: rkey}
		b, err := k.MarshalBinary()
		if err != nil {
			if !errors.Is(err, ucx.ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		var got ucx.RegionKey
		if err := got.UnmarshalBinary(b); err != nil || !bytes.Equal(got.Rkey, rkey) {
			t.Fatalf("an accepted rkey does not round-trip: %v", err)
		}
		// Walk it again independently: every domain's key fits.
		p := 9
		for i := 0; i < popcount(binary.LittleEndian.Uint64(rkey)); i++ {
			if p >= len(rkey) || p+1+int(rkey[p]) > len(rkey) {
				t.Fatalf("accepted an rkey whose domain %d runs past its end", i)
			}
			p += 1 + int(rkey[p])
		}
	})
}

func popcount(x uint64) int {
	n := 0
	for ; x != 0; x &= x - 1 {
		n++
	}
	return n
}

// FuzzWorkerAddress feeds arbitrary bytes to the decoder of worker
// addresses: it never panics, and what it accepts re-encodes to the same
// bytes.
func FuzzWorkerAddress(f *testing.F) {
	f.Add([]byte("ucWA\x01\x01\x0d\x00\x03\x00\x00\x00\x01\x02\x03\x00\x00\x00\x00"))
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, b []byte) {
		var a ucx.WorkerAddress
		if err := a.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ucx.ErrMalformed) {
				t.Fatalf("error not ErrMalformed: %v", err)
			}
			return
		}
		again, err := a.MarshalBinary()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("an accepted address does not re-encode to the same bytes: %v", err)
		}
	})
}
