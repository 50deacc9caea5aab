package cudaipc

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The vectors in testdata/region are the examples of docs/region.md as
// files, for implementations in other languages to test against: each
// valid region and event descriptor in both encodings, and a list of
// invalid encodings with the field a reader must name. go test -run
// TestRegionVectors -update rewrites them from the code.
var update = flag.Bool("update", false, "rewrite testdata/region from the code")

const vectorDir = "testdata/region"

type vector struct {
	name string
	bin  []byte
	json []byte
	back func(b []byte) (any, error) // decodes either encoding
	want any
}

func regionVectors() []vector {
	decodeRegion := func(b []byte) (any, error) { return DecodeRegion(b) }
	decodeEvent := func(b []byte) (any, error) {
		var d EventDescriptor
		var err error
		if bytes.HasPrefix(b, []byte("CIPE")) {
			err = d.UnmarshalBinary(b)
		} else {
			err = d.UnmarshalJSON(b)
		}
		return d, err
	}
	var out []vector
	for _, v := range []struct {
		name string
		val  interface {
			MarshalBinary() ([]byte, error)
			MarshalJSON() ([]byte, error)
		}
		back func([]byte) (any, error)
		want any
	}{
		{"cuda-ipc", exampleRegion(), decodeRegion, exampleRegion()},
		{"vmm-fd", exampleVMMRegion(), decodeRegion, exampleVMMRegion()},
		{"vmm-fd-pieces", examplePiecesRegion(), decodeRegion, examplePiecesRegion()},
		{"event", exampleEvent(), decodeEvent, exampleEvent()},
	} {
		b, err := v.val.MarshalBinary()
		if err != nil {
			panic(err)
		}
		j, err := v.val.MarshalJSON()
		if err != nil {
			panic(err)
		}
		out = append(out, vector{v.name, b, j, v.back, v.want})
	}
	return out
}

// invalidVector is one entry of testdata/region/invalid.json.
type invalidVector struct {
	Name     string `json:"name"`
	Encoding string `json:"encoding"` // "binary" (Data is hex) or "json" (Data is the text)
	Data     string `json:"data"`
	Field    string `json:"field"` // the field a reader must name
}

func invalidVectors() []invalidVector {
	var out []invalidVector
	bin := func(name, field string, base Region, edit func(b []byte), crc bool) {
		b, _ := base.MarshalBinary()
		edit(b)
		if crc {
			fixCRC(b)
		}
		out = append(out, invalidVector{name, "binary", hex.EncodeToString(b), field})
	}
	js := func(name, field string, base Region, old, new string) {
		j, _ := json.Marshal(base)
		if !strings.Contains(string(j), old) {
			panic(name + ": no " + old)
		}
		out = append(out, invalidVector{name, "json", strings.Replace(string(j), old, new, 1), field})
	}
	ipc, vmm := exampleRegion(), exampleVMMRegion()
	bin("bad magic", "magic", ipc, func(b []byte) { b[0] = 'X' }, true)
	bin("version 2", "version", ipc, func(b []byte) { b[4] = 2 }, true)
	bin("bad crc", "crc32", ipc, func(b []byte) { b[100] ^= 1 }, false)
	bin("reserved flags", "flags", ipc, func(b []byte) { b[116] = 1 }, true)
	bin("kind host (reserved)", "kind", ipc, func(b []byte) { b[6] = 3 }, true)
	bin("kind 0", "kind", ipc, func(b []byte) { b[6] = 0 }, true)
	bin("zero handle", "handle", ipc, func(b []byte) { clear(b[8:72]) }, true)
	bin("size past the allocation", "size", ipc, func(b []byte) { b[82] = 0x80 }, true)
	bin("size >= 2^63", "size", ipc, func(b []byte) { b[87] = 0x80 }, true)
	bin("zero buffer id", "buffer_id", ipc, func(b []byte) { clear(b[144:152]) }, true)
	bin("vmm-fd: zero allocation id", "allocation_id", vmm, func(b []byte) { clear(b[8:24]) }, true)
	bin("vmm-fd: reserved handle bytes", "handle", vmm, func(b []byte) { b[40] = 1 }, true)
	bin("vmm-fd: buffer id", "buffer_id", vmm, func(b []byte) { b[144] = 1 }, true)
	pcs := examplePiecesRegion()
	bin("pieces: version 1 with pieces", "length", pcs, func(b []byte) { b[4] = 1 }, true)
	bin("pieces: version 3", "version", pcs, func(b []byte) { b[4] = 3 }, true)
	bin("pieces: count 1", "pieces", pcs, func(b []byte) { b[160], b[161] = 1, 0 }, true)
	bin("pieces: count past the bytes", "length", pcs, func(b []byte) { b[160] = 4 }, true)
	bin("pieces: zero allocation id", "pieces", pcs, func(b []byte) { clear(b[164:180]) }, true)
	bin("pieces: an allocation twice", "pieces", pcs, func(b []byte) { copy(b[188:204], b[164:180]) }, true)
	bin("pieces: zero size", "pieces", pcs, func(b []byte) { clear(b[180:188]) }, true)
	bin("pieces: size past the pieces", "size", pcs, func(b []byte) { b[83] = 4 }, true) // 48 MiB -> 64 MiB at 4 MiB of 60
	bin("pieces: bad crc", "crc32", pcs, func(b []byte) { b[170] ^= 1 }, false)
	js("pieces: version 1", "version", pcs, `"version":2`, `"version":1`)
	js("pieces: empty list", "pieces", pcs, `,"more_pieces":[{"allocation_id":"b1b2c3d4e5f60718293a4b5c6d7e8f91","alloc_size":20971520},{"allocation_id":"c1b2c3d4e5f60718293a4b5c6d7e8f92","alloc_size":20971520}]`, `,"more_pieces":[]`)
	js("pieces: missing id", "pieces", pcs, `{"allocation_id":"b1b2c3d4e5f60718293a4b5c6d7e8f91",`, `{`)
	js("pieces: unknown piece field", "json", pcs, `"alloc_size":20971520}`, `"alloc_size":20971520,"offset":0}`)
	js("unknown field", "json", ipc, `"size"`, `"sise"`)
	js("kind name", "kind", ipc, `"cuda-ipc"`, `"ipc"`)
	js("negative offset", "offset", ipc, `"offset":1048576`, `"offset":-1`)
	js("exporter_base without 0x", "exporter_base", ipc, `"0x7f3a00000000"`, `"7f3a00000000"`)
	js("vmm-fd: handle field", "handle", vmm, `"offset"`, `"handle":"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+Pw==","offset"`)
	js("vmm-fd: buffer_id field", "buffer_id", vmm, `"offset"`, `"buffer_id":0,"offset"`)
	js("vmm-fd: missing allocation_id", "allocation_id", vmm, `"allocation_id":"a1b2c3d4e5f60718293a4b5c6d7e8f90",`, ``)
	js("cuda-ipc: allocation_id field", "allocation_id", ipc, `"offset"`, `"allocation_id":"a1b2c3d4e5f60718293a4b5c6d7e8f90","offset"`)
	return out
}

// sameValue compares two decoded vectors: Regions with Equal (they hold a
// slice), anything else with ==.
func sameValue(a, b any) bool {
	if r, ok := a.(Region); ok {
		o, ok := b.(Region)
		return ok && r.Equal(o)
	}
	return a == b
}

func TestRegionVectors(t *testing.T) {
	inv, err := json.MarshalIndent(invalidVectors(), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	inv = append(inv, '\n')
	files := map[string][]byte{"invalid.json": inv}
	for _, v := range regionVectors() {
		files[v.name+".bin"] = v.bin
		files[v.name+".json"] = v.json
	}
	if *update {
		if err := os.MkdirAll(vectorDir, 0o755); err != nil {
			t.Fatal(err)
		}
		for name, b := range files {
			if err := os.WriteFile(filepath.Join(vectorDir, name), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
	}
	for name, want := range files {
		got, err := os.ReadFile(filepath.Join(vectorDir, name))
		if err != nil || !bytes.Equal(got, want) {
			t.Errorf("%s/%s differs from what the code writes (%v); run go test -run TestRegionVectors -update and review the diff", vectorDir, name, err)
		}
	}
	// Each valid vector decodes, from the files, to its value.
	for _, v := range regionVectors() {
		for _, ext := range []string{".bin", ".json"} {
			b, _ := os.ReadFile(filepath.Join(vectorDir, v.name+ext))
			got, err := v.back(b)
			if err != nil || !sameValue(got, v.want) {
				t.Errorf("%s%s: %v\n%+v", v.name, ext, err, got)
			}
		}
	}
	// Each invalid vector is refused, naming its field.
	var list []invalidVector
	if err := json.Unmarshal(inv, &list); err != nil {
		t.Fatal(err)
	}
	for _, v := range list {
		var r Region
		if v.Encoding == "binary" {
			b, herr := hex.DecodeString(v.Data)
			if herr != nil {
				t.Fatal(herr)
			}
			err = r.UnmarshalBinary(b)
		} else {
			err = r.UnmarshalJSON([]byte(v.Data))
		}
		var re *RegionError
		if !errors.As(err, &re) || re.Field != v.Field {
			t.Errorf("%s: %v, want field %s", v.Name, err, v.Field)
		}
	}
}
