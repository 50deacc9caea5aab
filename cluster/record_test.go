package cluster

import (
	"bytes"
	"errors"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"
)

var testSecret, _ = NewSecret([]byte("a-test-secret-of-enough-bytes"))

func randBytes(n int, seed uint64) []byte {
	b := make([]byte, n)
	rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8)}).Read(b)
	return b
}

func sampleObject() Object {
	b := randBytes(9<<20+3, 1)
	return Object{Name: "ns/model w", Owner: 1000, Shared: true, Version: 4, Shard: 1, Shards: 2,
		Size: int64(len(b)), ChunkSize: DefaultChunkSize, Sums: Checksums(b, DefaultChunkSize),
		ID: NewID(), Origin: "node-a", Sealed: time.Now().UTC().Round(0)}
}

func TestSealOpenRoundTrip(t *testing.T) {
	o := sampleObject()
	val, err := Seal(testSecret, "/k/obj", &o)
	if err != nil {
		t.Fatal(err)
	}
	var got Object
	if err := Open(testSecret, "/k/obj", val, &got); err != nil {
		t.Fatal(err)
	}
	if got.Name != o.Name || got.ID != o.ID || len(got.Sums) != 3 || got.Sums[2] != o.Sums[2] || !got.Sealed.Equal(o.Sealed) {
		t.Fatalf("got %+v", got)
	}
	n := Node{Name: "node-a", Worker: randBytes(300, 2), Control: "[fd00::1]:7100"}
	val, err = Seal(testSecret, "/k/node", &n)
	if err != nil {
		t.Fatal(err)
	}
	var gn Node
	if err := Open(testSecret, "/k/node", val, &gn); err != nil || string(gn.Worker) != string(n.Worker) {
		t.Fatalf("node %+v %v", gn, err)
	}
}

func TestOpenRejects(t *testing.T) {
	o := sampleObject()
	val, err := Seal(testSecret, "/k/obj", &o)
	if err != nil {
		t.Fatal(err)
	}
	other, _ := NewSecret([]byte("another-secret-of-16+bytes"))
	flipped := append([]byte(nil), val...)
	flipped[len(flipped)-5] ^= 1
	cases := map[string]struct {
		s   Secret
		key string
		val []byte
	}{
		"another secret":  {other, "/k/obj", val},
		"another key":     {testSecret, "/k/obj2", val},
		"a flipped bit":   {testSecret, "/k/obj", flipped},
		"empty":           {testSecret, "/k/obj", nil},
		"short":           {testSecret, "/k/obj", val[:20]},
		"no body":         {testSecret, "/k/obj", val[:35]},
		"too long":        {testSecret, "/k/obj", make([]byte, MaxRecordLen+1)},
		"no magic":        {testSecret, "/k/obj", append([]byte("xx1"), val[3:]...)},
		"MAC of the body": {testSecret, "/k/obj", resealRaw(testSecret, "/k/obj", `{"name":"x"}`)},
		"unknown field":   {testSecret, "/k/obj", resealRaw(testSecret, "/k/obj", strings.Replace(string(val[35:]), `"name"`, `"evil":1,"name"`, 1))},
		"trailing":        {testSecret, "/k/obj", resealRaw(testSecret, "/k/obj", string(val[35:])+"{}")},
	}
	for name, c := range cases {
		var got Object
		if err := Open(c.s, c.key, c.val, &got); !errors.Is(err, ErrBadRecord) {
			t.Errorf("%s: %v, want ErrBadRecord", name, err)
		}
	}
	if err := Open(Secret{}, "/k/obj", val, &Object{}); !errors.Is(err, ErrSecret) {
		t.Errorf("no secret: %v", err)
	}
}

// resealRaw seals any body, valid or not, with a correct MAC: what a
// holder of the secret with a bug (or a newer version) might write.
func resealRaw(s Secret, key, body string) []byte {
	out := append([]byte(nil), recordMagic...)
	out = append(out, recordMAC(s, key, []byte(body))...)
	return append(out, body...)
}

func TestValidation(t *testing.T) {
	good := sampleObject()
	bad := map[string]func(*Object){
		"empty name":       func(o *Object) { o.Name = "" },
		"UID: prefix":      func(o *Object) { o.Name = "12:x" },
		"control char":     func(o *Object) { o.Name = "a\x00b" },
		"zero size":        func(o *Object) { o.Size = 0; o.Sums = nil },
		"negative size":    func(o *Object) { o.Size = -1 },
		"huge size":        func(o *Object) { o.Size = 1 << 41 },
		"chunk not pow2":   func(o *Object) { o.ChunkSize = 3 << 20 },
		"chunk too small":  func(o *Object) { o.ChunkSize = 4096 },
		"sums short":       func(o *Object) { o.Sums = o.Sums[:2] },
		"shard past":       func(o *Object) { o.Shard = 2 },
		"too many shards":  func(o *Object) { o.Shards = MaxShards + 1 },
		"shard no version": func(o *Object) { o.Version = 0 },
		"bad id":           func(o *Object) { o.ID = "xyz" },
		"bad origin":       func(o *Object) { o.Origin = "a/b" },
		"manifest too big": func(o *Object) { o.Manifest = make([]byte, MaxManifestLen+1) },
	}
	for name, f := range bad {
		o := good
		o.Sums = append([]uint32(nil), good.Sums...)
		f(&o)
		if _, err := Seal(testSecret, "/k", &o); !errors.Is(err, ErrBadRecord) {
			t.Errorf("%s: Seal %v, want ErrBadRecord", name, err)
		}
	}
	for _, n := range []Node{
		{Name: "a", Worker: make([]byte, MaxWorkerAddrLen+1), Control: "h:1"},
		{Name: "a", Worker: []byte{1}, Control: "h"},
		{Name: "a", Worker: []byte{1}, Control: "h:99999"},
		{Name: "a", Worker: []byte{1}, Control: ":80"},
		{Name: "ä", Worker: []byte{1}, Control: "h:1"},
		{Name: "..", Worker: []byte{1}, Control: "h:1"},
	} {
		if _, err := Seal(testSecret, "/k", &n); !errors.Is(err, ErrBadRecord) {
			t.Errorf("node %+v: %v, want ErrBadRecord", n, err)
		}
	}
}

// The largest object record (MaxChunks checksums of the most digits, a
// manifest of MaxManifestLen bytes, the longest name) fits in MaxRecordLen.
func TestLargestObjectRecordFits(t *testing.T) {
	o := sampleObject()
	o.Name = strings.Repeat("n", 255)
	o.ChunkSize = MinChunkSize
	o.Size = MaxChunks * MinChunkSize
	o.Sums = make([]uint32, MaxChunks)
	for i := range o.Sums {
		o.Sums[i] = 4_000_000_000 + uint32(i)
	}
	o.Manifest = bytes.Repeat([]byte{0xff}, MaxManifestLen)
	b, err := Seal(testSecret, "/k", &o)
	if err != nil {
		t.Fatalf("largest record: %v", err)
	}
	if len(b) > MaxRecordLen {
		t.Fatalf("largest record is %d bytes, over %d", len(b), MaxRecordLen)
	}
	var back Object
	if err := Open(testSecret, "/k", b, &back); err != nil || !bytes.Equal(back.Manifest, o.Manifest) {
		t.Fatalf("round trip: %v", err)
	}
}

func TestChunkSizes(t *testing.T) {
	for _, c := range []struct{ size, chunk int64 }{
		{1, DefaultChunkSize}, {4 << 30, DefaultChunkSize}, {4<<30 + 1, 8 << 20}, {8 << 30, 8 << 20},
		{8<<30 + 1, LargeChunkSize}, {16_060_522_496, LargeChunkSize}, {1 << 40, LargeChunkSize},
		{1<<40 + 1, 32 << 20}, {2 << 40, 32 << 20},
	} {
		if got := ChunkSizeFor(c.size); got != c.chunk {
			t.Errorf("ChunkSizeFor(%d) = %d, want %d", c.size, got, c.chunk)
		}
	}
	for _, c := range []struct{ size, base, chunk int64 }{
		{5<<20 + 1, 1 << 20, 1 << 20}, {MaxChunks << 20, 1 << 20, 1 << 20}, {MaxChunks<<20 + 1, 1 << 20, 2 << 20},
		{1, MinChunkSize, MinChunkSize}, {1 << 40, MaxChunkSize, MaxChunkSize}, {16 << 30, 16 << 20, 16 << 20},
	} {
		if got := ChunkSizeFrom(c.size, c.base); got != c.chunk {
			t.Errorf("ChunkSizeFrom(%d, %d) = %d, want %d", c.size, c.base, got, c.chunk)
		}
	}
	b := randBytes(10<<20, 3)
	sums := Checksums(b, DefaultChunkSize)
	if len(sums) != 3 || sums[0] != Checksum(b[:DefaultChunkSize]) || sums[2] != Checksum(b[8<<20:]) {
		t.Fatalf("sums %v", sums)
	}
}

func TestLoadSecret(t *testing.T) {
	dir := t.TempDir()
	p := filepath.Join(dir, "secret")
	if err := os.WriteFile(p, []byte("  0123456789abcdef0123\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	s, err := LoadSecret(p)
	if err != nil {
		t.Fatal(err)
	}
	s2, _ := NewSecret([]byte("0123456789abcdef0123"))
	if s.key != s2.key {
		t.Fatal("white space around the secret changed the key")
	}
	if err := os.Chmod(p, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadSecret(p); !errors.Is(err, ErrSecret) || !strings.Contains(err.Error(), "chmod 600") {
		t.Fatalf("world-readable secret: %v", err)
	}
	short := filepath.Join(dir, "short")
	os.WriteFile(short, []byte("tooshort"), 0o600)
	if _, err := LoadSecret(short); !errors.Is(err, ErrSecret) {
		t.Fatalf("short secret: %v", err)
	}
	if _, err := LoadSecret(filepath.Join(dir, "missing")); !errors.Is(err, ErrSecret) {
		t.Fatalf("missing secret: %v", err)
	}
}

func FuzzOpenObject(f *testing.F) {
	o := sampleObject()
	val, _ := Seal(testSecret, "/k", &o)
	f.Add(val)
	f.Add(resealRaw(testSecret, "/k", `{"name":"x","size":1,"chunk":65536,"sums":[1],"id":"00000000000000000000000000000000","origin":"a","sealed":"2026-01-01T00:00:00Z"}`))
	f.Add([]byte("cr1"))
	f.Fuzz(func(t *testing.T, b []byte) {
		// Both as received and with a valid MAC: the decoder behind the
		// MAC must hold too.
		for _, v := range [][]byte{b, resealRaw(testSecret, "/k", string(b))} {
			var got Object
			if err := Open(testSecret, "/k", v, &got); err != nil {
				if !errors.Is(err, ErrBadRecord) {
					t.Fatalf("error does not wrap ErrBadRecord: %v", err)
				}
				continue
			}
			if got.validate() != nil {
				t.Fatalf("accepted an invalid record: %+v", got)
			}
		}
	})
}

func FuzzOpenNode(f *testing.F) {
	n := Node{Name: "a", Worker: []byte{1, 2, 3}, Control: "10.0.0.1:7100"}
	val, _ := Seal(testSecret, "/n", &n)
	f.Add(val[35:])
	f.Fuzz(func(t *testing.T, body []byte) {
		var got Node
		if err := Open(testSecret, "/n", resealRaw(testSecret, "/n", string(body)), &got); err != nil {
			if !errors.Is(err, ErrBadRecord) {
				t.Fatalf("error does not wrap ErrBadRecord: %v", err)
			}
			return
		}
		if len(got.Worker) > MaxWorkerAddrLen || ValidateControlAddr(got.Control) != nil {
			t.Fatalf("accepted %+v", got)
		}
	})
}

// ChecksumsParallel gives Checksums' sums for every split of an object into
// chunks: empty, under one chunk, exact multiples and a short last chunk.
func TestChecksumsParallel(t *testing.T) {
	const chunk = 4 << 10
	b := randBytes(37*chunk+123, 77)
	for _, n := range []int{0, 1, chunk - 1, chunk, chunk + 1, 2 * chunk, 8*chunk + 5, 37 * chunk, len(b)} {
		want := Checksums(b[:n], chunk)
		got := ChecksumsParallel(b[:n], chunk)
		if !slices.Equal(got, want) {
			t.Fatalf("%d bytes: parallel sums %v, want %v", n, got, want)
		}
	}
}

// TestValidChunkSize: powers of two from MinChunkSize to MaxChunkSize, and
// nothing else (the bound of records, node.Config.ChunkSize and the CLI).
func TestValidChunkSize(t *testing.T) {
	for c, want := range map[int64]bool{
		MinChunkSize: true, 4 << 20: true, MaxChunkSize: true,
		MinChunkSize / 2: false, MaxChunkSize * 2: false, 3 << 20: false,
		0: false, -(4 << 20): false, 1: false,
	} {
		if got := ValidChunkSize(c); got != want {
			t.Errorf("ValidChunkSize(%d) = %v, want %v", c, got, want)
		}
	}
}

func FuzzOpenTombstone(f *testing.F) {
	ts := Tombstone{Owner: 1000, Name: "w", IDs: []string{NewID(), NewID()}, Node: "a", Deleted: time.Unix(1, 0).UTC()}
	val, _ := Seal(testSecret, "/t", &ts)
	f.Add(val)
	f.Add(val[35:])
	f.Add([]byte(`{"owner":1,"name":"x","ids":[],"node":"a","deleted":"2026-01-01T00:00:00Z"}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		for _, v := range [][]byte{b, resealRaw(testSecret, "/t", string(b))} {
			var got Tombstone
			if err := Open(testSecret, "/t", v, &got); err != nil {
				if !errors.Is(err, ErrBadRecord) {
					t.Fatalf("error does not wrap ErrBadRecord: %v", err)
				}
				continue
			}
			if got.validate() != nil || len(got.IDs) == 0 {
				t.Fatalf("accepted an invalid tombstone: %+v", got)
			}
		}
	})
}
