package cudaipc

import (
	"bytes"
	"encoding/hex"
	"encoding/json"
	"errors"
	"hash/crc32"
	"math"
	"os"
	"strings"
	"testing"
)

// exampleRegion is the region of docs/region.md's examples.
func exampleRegion() Region {
	var h MemHandle
	for i := range h {
		h[i] = byte(i)
	}
	u, _ := ParseUUID("GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8")
	boot, _ := ParseBootID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
	return Region{
		Version: 1, Kind: KindCUDAIPC, Handle: h,
		Offset: 1 << 20, Size: 4096, AllocSize: 8 << 20, Device: u,
		ExporterPID: 4242, PIDNamespace: 4026531836, BootID: boot,
		BufferID: 17, ExporterBase: 0x7f3a00000000,
	}
}

// exampleVMMRegion is the vmm-fd region of docs/region.md's examples.
func exampleVMMRegion() Region {
	r := exampleRegion()
	r.Kind, r.Handle, r.BufferID = KindVMMFD, MemHandle{}, 0
	r.AllocationID, _ = ParseAllocationID("a1b2c3d4e5f60718293a4b5c6d7e8f90")
	r.Offset, r.Size, r.AllocSize = 2<<20, 1<<20, 32<<20
	r.ExporterBase = 0x7f3b00000000
	return r
}

// examplePiecesRegion is the version 2 example of docs/region.md: 48 MiB
// at offset 4 MiB of a range of three 20 MiB allocations (PyTorch's
// expandable segments), the first one's id and base as in
// exampleVMMRegion.
func examplePiecesRegion() Region {
	r := exampleVMMRegion()
	r.Version = RegionVersionPieces
	r.Offset, r.Size, r.AllocSize = 4<<20, 48<<20, 20<<20
	id2, _ := ParseAllocationID("b1b2c3d4e5f60718293a4b5c6d7e8f91")
	id3, _ := ParseAllocationID("c1b2c3d4e5f60718293a4b5c6d7e8f92")
	r.MorePieces = []Piece{{id2, 20 << 20}, {id3, 20 << 20}}
	return r
}

// exampleRegionHex is exampleRegion's binary encoding, as docs/region.md
// shows it.
const exampleRegionHex = "43495052010001000001020304050607" +
	"08090a0b0c0d0e0f1011121314151617" +
	"18191a1b1c1d1e1f2021222324252627" +
	"28292a2b2c2d2e2f3031323334353637" +
	"38393a3b3c3d3e3f0000100000000000" +
	"00100000000000000000800000000000" +
	"5f1c2a3b4d5e6f708192a3b4c5d6e7f8" +
	"9210000000000000fcffffef00000000" +
	"0f1e2d3c4b5a69788796a5b4c3d2e1f0" +
	"1100000000000000000000003a7f0000" +
	"08218636"

func TestRegionBinaryGolden(t *testing.T) {
	r := exampleRegion()
	b, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != RegionBinarySize {
		t.Fatalf("%d bytes", len(b))
	}
	if got := hex.EncodeToString(b); got != exampleRegionHex {
		t.Fatalf("encoding changed; docs/region.md shows the old one:\n got %s\nwant %s", got, exampleRegionHex)
	}
	var back Region
	if err := back.UnmarshalBinary(b); err != nil || !back.Equal(r) {
		t.Fatalf("round trip: %v\n%+v", err, back)
	}
	if d, err := DecodeRegion(b); err != nil || !d.Equal(r) {
		t.Fatalf("DecodeRegion binary: %v", err)
	}
}

func TestRegionJSONGolden(t *testing.T) {
	r := exampleRegion()
	b, err := json.Marshal(r)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"version":1,"kind":"cuda-ipc","handle":"AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+Pw==","offset":1048576,"size":4096,"alloc_size":8388608,"device":"GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8","exporter_pid":4242,"pid_namespace":4026531836,"boot_id":"0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0","buffer_id":17,"exporter_base":"0x7f3a00000000"}`
	if string(b) != want {
		t.Fatalf("JSON changed; docs/region.md shows the old one:\n got %s\nwant %s", b, want)
	}
	var back Region
	if err := json.Unmarshal(b, &back); err != nil || !back.Equal(r) {
		t.Fatalf("round trip: %v", err)
	}
	// Whitespace, field order, upper-case hex digits and a "GPU-"-less UUID
	// are accepted: other languages write them.
	loose := `{ "exporter_base": "0x7F3A00000000", "buffer_id": 17, "boot_id": "0F1E2D3C-4B5A-6978-8796-A5B4C3D2E1F0",
	  "pid_namespace": 4026531836, "exporter_pid": 4242, "device": "5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8",
	  "alloc_size": 8388608, "size": 4096, "offset": 1048576,
	  "handle": "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8gISIjJCUmJygpKissLS4vMDEyMzQ1Njc4OTo7PD0+Pw==",
	  "kind": "cuda-ipc", "version": 1 }`
	if d, err := DecodeRegion([]byte(loose)); err != nil || !d.Equal(r) {
		t.Fatalf("loose JSON: %v", err)
	}
}

func TestRegionValidate(t *testing.T) {
	for _, tc := range []struct {
		field string
		edit  func(*Region)
	}{
		{"version", func(r *Region) { r.Version = 2 }},
		{"kind", func(r *Region) { r.Kind = 0 }},
		{"allocation_id", func(r *Region) { r.Kind = KindVMMFD }},
		{"allocation_id", func(r *Region) { r.AllocationID = AllocationID{1} }},
		{"kind", func(r *Region) { r.Kind = KindHost }},
		{"kind", func(r *Region) { r.Kind = 99 }},
		{"handle", func(r *Region) { r.Handle = MemHandle{} }},
		{"size", func(r *Region) { r.Size = 0 }},
		{"size", func(r *Region) { r.Size = -1 }},
		{"offset", func(r *Region) { r.Offset = -1 }},
		{"alloc_size", func(r *Region) { r.AllocSize = 0 }},
		{"size", func(r *Region) { r.Offset, r.Size = r.AllocSize-10, 11 }},
		{"size", func(r *Region) { r.Offset = r.AllocSize + 1 }},
		{"size", func(r *Region) { r.Offset, r.Size, r.AllocSize = math.MaxInt64, math.MaxInt64, math.MaxInt64 }},
		{"size", func(r *Region) { r.Offset, r.Size, r.AllocSize = 1, math.MaxInt64, math.MaxInt64 }},
		{"device", func(r *Region) { r.Device = UUID{} }},
		{"exporter_pid", func(r *Region) { r.ExporterPID = 0 }},
		{"exporter_pid", func(r *Region) { r.ExporterPID = math.MaxInt32 + 1 }},
		{"pid_namespace", func(r *Region) { r.PIDNamespace = 0 }},
		{"boot_id", func(r *Region) { r.BootID = BootID{} }},
		{"buffer_id", func(r *Region) { r.BufferID = 0 }},
		{"exporter_base", func(r *Region) { r.ExporterBase = 0 }},
		{"exporter_base", func(r *Region) { r.ExporterBase = math.MaxUint64 - 100 }},
	} {
		r := exampleRegion()
		tc.edit(&r)
		err := r.Validate()
		var re *RegionError
		if !errors.As(err, &re) || re.Field != tc.field || !errors.Is(err, ErrInvalidRegion) {
			t.Errorf("%s: %v", tc.field, err)
			continue
		}
		if _, err := r.MarshalBinary(); !errors.Is(err, ErrInvalidRegion) {
			t.Errorf("%s: MarshalBinary of an invalid region: %v", tc.field, err)
		}
		if _, err := json.Marshal(r); !errors.Is(err, ErrInvalidRegion) {
			t.Errorf("%s: MarshalJSON of an invalid region: %v", tc.field, err)
		}
	}
	// The edges that are valid.
	r := exampleRegion()
	r.Offset, r.Size = 0, r.AllocSize
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	r.Offset, r.Size = r.AllocSize-1, 1
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestRegionBinaryRejects(t *testing.T) {
	good, _ := exampleRegion().MarshalBinary()
	field := func(b []byte) string {
		var r Region
		var re *RegionError
		if err := r.UnmarshalBinary(b); !errors.As(err, &re) {
			return "accepted"
		}
		return re.Field
	}
	if f := field(good[:10]); f != "length" {
		t.Errorf("short: %s", f)
	}
	if f := field(append(append([]byte{}, good...), 0)); f != "length" {
		t.Errorf("long: %s", f)
	}
	// Every single-byte change is caught: by the magic, the version or the
	// checksum.
	for i := range good {
		b := append([]byte{}, good...)
		b[i] ^= 0x40
		if f := field(b); f == "accepted" {
			t.Fatalf("flipping byte %d was accepted", i)
		}
	}
	// A field error behind a correct checksum is reported by field.
	b := append([]byte{}, good...)
	b[116] = 1
	fixCRC(b)
	if f := field(b); f != "flags" {
		t.Errorf("flags: %s", f)
	}
	b = append([]byte{}, good...)
	b[80+7] = 0x80 // size >= 2^63
	fixCRC(b)
	if f := field(b); f != "size" {
		t.Errorf("huge size: %s", f)
	}
	b = append([]byte{}, good...)
	b[6] = 3 // kind host, reserved
	fixCRC(b)
	if f := field(b); f != "kind" {
		t.Errorf("reserved kind: %s", f)
	}
	b = append([]byte{}, good...)
	b[6] = 2 // kind vmm-fd with a handle's bytes
	fixCRC(b)
	if f := field(b); f != "handle" {
		t.Errorf("vmm-fd with handle bytes: %s", f)
	}
}

func TestRegionVMMFDValidate(t *testing.T) {
	for _, tc := range []struct {
		field string
		edit  func(*Region)
	}{
		{"allocation_id", func(r *Region) { r.AllocationID = AllocationID{} }},
		{"handle", func(r *Region) { r.Handle = MemHandle{1} }},
		{"buffer_id", func(r *Region) { r.BufferID = 3 }},
		{"size", func(r *Region) { r.Offset, r.Size = r.AllocSize-1, 2 }},
		{"pid_namespace", func(r *Region) { r.PIDNamespace = 0 }},
		{"exporter_base", func(r *Region) { r.ExporterBase = 0 }},
	} {
		r := exampleVMMRegion()
		tc.edit(&r)
		var re *RegionError
		if err := r.Validate(); !errors.As(err, &re) || re.Field != tc.field {
			t.Errorf("%s: %v", tc.field, err)
		}
	}
	r := exampleVMMRegion()
	if err := r.Validate(); err != nil {
		t.Fatal(err)
	}
	s, err := r.Sub(4096, 8192)
	if err != nil || s.AllocationID != r.AllocationID || s.Offset != r.Offset+4096 || s.Kind != KindVMMFD {
		t.Fatalf("Sub: %+v %v", s, err)
	}
	if !strings.Contains(r.String(), r.AllocationID.String()) || !strings.Contains(r.String(), "vmm-fd") {
		t.Fatalf("String: %s", r)
	}
	// A field of the other kind is refused by name in JSON, even when zero.
	good, _ := json.Marshal(r)
	for _, tc := range []struct{ add, field string }{
		{`"handle":"` + strings.Repeat("A", 86) + `==",`, "handle"},
		{`"buffer_id":0,`, "buffer_id"},
	} {
		in := strings.Replace(string(good), `"offset"`, tc.add+`"offset"`, 1)
		var re *RegionError
		if _, err := DecodeRegion([]byte(in)); !errors.As(err, &re) || re.Field != tc.field {
			t.Errorf("%s in a vmm-fd region: %v", tc.field, err)
		}
	}
	ipc, _ := json.Marshal(exampleRegion())
	in := strings.Replace(string(ipc), `"offset"`, `"allocation_id":"a1b2c3d4e5f60718293a4b5c6d7e8f90","offset"`, 1)
	var re *RegionError
	if _, err := DecodeRegion([]byte(in)); !errors.As(err, &re) || re.Field != "allocation_id" {
		t.Errorf("allocation_id in a cuda-ipc region: %v", err)
	}
	if a, b := NewAllocationID(), NewAllocationID(); a == b || a.IsZero() {
		t.Fatal("NewAllocationID repeats or is zero")
	}
	for _, bad := range []string{"", "a1b2", strings.Repeat("g", 32), strings.Repeat("a", 33)} {
		if _, err := ParseAllocationID(bad); err == nil {
			t.Errorf("ParseAllocationID(%q) accepted", bad)
		}
	}
}

func fixCRC(b []byte) {
	sum := crc32.ChecksumIEEE(b[:len(b)-4])
	b[len(b)-4], b[len(b)-3], b[len(b)-2], b[len(b)-1] = byte(sum), byte(sum>>8), byte(sum>>16), byte(sum>>24)
}

func TestRegionJSONRejects(t *testing.T) {
	good, _ := json.Marshal(exampleRegion())
	for _, tc := range []struct{ name, in, field string }{
		{"unknown field", strings.Replace(string(good), `"size"`, `"sise"`, 1), "json"},
		{"trailing data", string(good) + `{}`, "json"},
		{"not an object", `[1,2]`, "json"},
		{"bad kind", strings.Replace(string(good), `"cuda-ipc"`, `"ipc"`, 1), "kind"},
		{"bad base", strings.Replace(string(good), `"0x7f3a00000000"`, `"7f3a00000000"`, 1), "exporter_base"},
		{"base too long", strings.Replace(string(good), `"0x7f3a00000000"`, `"0x17f3a000000000000"`, 1), "exporter_base"},
		{"bad handle", strings.Replace(string(good), `"AAEC`, `"!AEC`, 1), "json"},
		{"bad uuid", strings.Replace(string(good), `"GPU-5f1c`, `"GPU-zz1c`, 1), "json"},
		{"negative offset", strings.Replace(string(good), `"offset":1048576`, `"offset":-1`, 1), "offset"},
		{"missing size", strings.Replace(string(good), `"size":4096,`, ``, 1), "size"},
		{"version 2", strings.Replace(string(good), `"version":1`, `"version":2`, 1), "version"},
	} {
		_, err := DecodeRegion([]byte(tc.in))
		var re *RegionError
		if !errors.As(err, &re) || re.Field != tc.field {
			t.Errorf("%s: %v, want field %s", tc.name, err, tc.field)
		}
	}
}

func TestRegionSub(t *testing.T) {
	r := exampleRegion()
	s, err := r.Sub(100, 200)
	if err != nil || s.Offset != r.Offset+100 || s.Size != 200 || s.Validate() != nil {
		t.Fatalf("%+v %v", s, err)
	}
	for _, c := range [][2]int64{{-1, 1}, {0, 0}, {0, r.Size + 1}, {r.Size, 1}, {1, math.MaxInt64}} {
		if _, err := r.Sub(c[0], c[1]); !errors.Is(err, ErrInvalidValue) {
			t.Errorf("Sub(%d, %d): %v", c[0], c[1], err)
		}
	}
	if strings.Contains(r.String(), "AAEC") {
		t.Fatal("String leaks the handle")
	}
}

func exampleEvent() EventDescriptor {
	r := exampleRegion()
	var h EventHandle
	for i := range h {
		h[i] = byte(255 - i)
	}
	return EventDescriptor{Version: 1, Handle: h, Device: r.Device, ExporterPID: r.ExporterPID, PIDNamespace: r.PIDNamespace, BootID: r.BootID}
}

func TestEventDescriptorEncodings(t *testing.T) {
	d := exampleEvent()
	b, err := d.MarshalBinary()
	if err != nil || len(b) != EventDescriptorBinarySize || !bytes.HasPrefix(b, []byte("CIPE")) {
		t.Fatalf("%x %v", b, err)
	}
	var back EventDescriptor
	if err := back.UnmarshalBinary(b); err != nil || back != d {
		t.Fatalf("binary round trip: %v", err)
	}
	for i := range b {
		c := append([]byte{}, b...)
		c[i] ^= 1
		if err := back.UnmarshalBinary(c); !errors.Is(err, ErrInvalidRegion) {
			t.Fatalf("flipped byte %d: %v", i, err)
		}
	}
	j, err := json.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"version":1,"handle":"//79/Pv6+fj39vX08/Lx8O/u7ezr6uno5+bl5OPi4eDf3t3c29rZ2NfW1dTT0tHQz87NzMvKycjHxsXEw8LBwA==","device":"GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8","exporter_pid":4242,"pid_namespace":4026531836,"boot_id":"0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"}`
	if string(j) != want {
		t.Fatalf("JSON changed; docs/region.md shows the old one:\n got %s\nwant %s", j, want)
	}
	back = EventDescriptor{}
	if err := json.Unmarshal(j, &back); err != nil || back != d {
		t.Fatalf("JSON round trip: %v", err)
	}
	for _, f := range []func(*EventDescriptor){
		func(d *EventDescriptor) { d.Version = 0 },
		func(d *EventDescriptor) { d.Handle = EventHandle{} },
		func(d *EventDescriptor) { d.Device = UUID{} },
		func(d *EventDescriptor) { d.ExporterPID = -1 },
		func(d *EventDescriptor) { d.PIDNamespace = 0 },
		func(d *EventDescriptor) { d.BootID = BootID{} },
	} {
		e := exampleEvent()
		f(&e)
		if _, err := json.Marshal(e); !errors.Is(err, ErrInvalidRegion) {
			t.Errorf("invalid descriptor encoded: %v", err)
		}
	}
}

func TestBootIDAndNSLink(t *testing.T) {
	b, err := ParseBootID("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
	if err != nil || b.String() != "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0" {
		t.Fatalf("%s %v", b, err)
	}
	for _, s := range []string{"", "0f1e2d3c4b5a69788796a5b4c3d2e1f0", "0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1fz", "0f1e2d3c-4b5a-6978-8796_a5b4c3d2e1f0"} {
		if _, err := ParseBootID(s); err == nil {
			t.Errorf("%q accepted", s)
		}
	}
	if n, err := parseNSLink("pid:[4026531836]"); err != nil || n != 4026531836 {
		t.Fatalf("%d %v", n, err)
	}
	for _, s := range []string{"pid:[]", "net:[1]", "pid:[0]", "pid:[12", "pid:[-1]"} {
		if _, err := parseNSLink(s); err == nil {
			t.Errorf("%q accepted", s)
		}
	}
	id, err := SelfIdentity()
	if err != nil {
		t.Skipf("no /proc here: %v", err)
	}
	if id.PIDNamespace == 0 || id.BootID.IsZero() || id.PID <= 0 {
		t.Fatalf("%+v", id)
	}
}

func FuzzRegionBinary(f *testing.F) {
	good, _ := exampleRegion().MarshalBinary()
	f.Add(good)
	pieces, _ := examplePiecesRegion().MarshalBinary()
	f.Add(pieces)
	f.Add(pieces[:RegionBinarySize+4])
	f.Add(good[:8])
	f.Add([]byte("CIPR\x01\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var r Region
		if err := r.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrInvalidRegion) {
				t.Fatalf("error is not a RegionError: %v", err)
			}
			return
		}
		if err := r.Validate(); err != nil {
			t.Fatalf("decoded an invalid region: %v", err)
		}
		again, err := r.MarshalBinary()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("re-encoding differs: %v\n%x\n%x", err, b, again)
		}
	})
}

func FuzzRegionJSON(f *testing.F) {
	good, _ := json.Marshal(exampleRegion())
	f.Add(good)
	pieces, _ := json.Marshal(examplePiecesRegion())
	f.Add(pieces)
	f.Add([]byte(`{"version":1}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, b []byte) {
		var r Region
		if err := json.Unmarshal(b, &r); err != nil {
			return
		}
		if err := r.Validate(); err != nil {
			t.Fatalf("decoded an invalid region: %v", err)
		}
		enc, err := json.Marshal(r)
		if err != nil {
			t.Fatal(err)
		}
		var r2 Region
		if err := json.Unmarshal(enc, &r2); err != nil || !r2.Equal(r) {
			t.Fatalf("re-decoding differs: %v", err)
		}
		if enc2, _ := json.Marshal(r2); !bytes.Equal(enc, enc2) {
			t.Fatalf("re-encoding differs:\n%s\n%s", enc, enc2)
		}
	})
}

func FuzzEventDescriptorBinary(f *testing.F) {
	good, _ := exampleEvent().MarshalBinary()
	f.Add(good)
	f.Add([]byte("CIPE\x01\x00"))
	f.Fuzz(func(t *testing.T, b []byte) {
		var d EventDescriptor
		if err := d.UnmarshalBinary(b); err != nil {
			if !errors.Is(err, ErrInvalidRegion) {
				t.Fatalf("error is not a RegionError: %v", err)
			}
			return
		}
		again, err := d.MarshalBinary()
		if err != nil || !bytes.Equal(again, b) {
			t.Fatalf("re-encoding differs: %v", err)
		}
	})
}

func FuzzEventDescriptorJSON(f *testing.F) {
	good, _ := json.Marshal(exampleEvent())
	f.Add(good)
	f.Fuzz(func(t *testing.T, b []byte) {
		var d EventDescriptor
		if err := json.Unmarshal(b, &d); err != nil {
			return
		}
		if err := d.Validate(); err != nil {
			t.Fatalf("decoded an invalid descriptor: %v", err)
		}
		enc, err := json.Marshal(d)
		if err != nil {
			t.Fatal(err)
		}
		var d2 EventDescriptor
		if err := json.Unmarshal(enc, &d2); err != nil || d2 != d {
			t.Fatalf("re-decoding differs: %v", err)
		}
	})
}

// TestDocExamples keeps docs/region.md's examples in step with the code
// and the vectors in testdata/region: every vector's hex dump is in the
// doc, and every JSON example of the doc decodes to a vector's region.
func TestDocExamples(t *testing.T) {
	doc, err := os.ReadFile("docs/region.md")
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	rest := string(doc)
	for {
		_, after, ok := strings.Cut(rest, "```json\n")
		if !ok {
			break
		}
		j, tail, _ := strings.Cut(after, "```")
		rest = tail
		if r, err := DecodeRegion([]byte(j)); err == nil {
			switch {
			case r.Equal(exampleRegion()):
				seen["cuda-ipc"] = true
			case r.Equal(exampleVMMRegion()):
				seen["vmm-fd"] = true
			case r.Equal(examplePiecesRegion()):
				seen["vmm-fd-pieces"] = true
			default:
				t.Errorf("a JSON example of the doc is no vector's region:\n%s", j)
			}
		} else if !strings.Contains(j, `"pieces"`) {
			t.Errorf("a JSON example of the doc does not decode: %v\n%s", err, j)
		}
	}
	if !seen["cuda-ipc"] || !seen["vmm-fd"] {
		t.Errorf("JSON examples found: %v; want cuda-ipc and vmm-fd", seen)
	}
	for _, v := range regionVectors() {
		if !strings.Contains(string(doc), hex.Dump(v.bin)) {
			t.Errorf("the doc's %s binary example differs from:\n%s", v.name, hex.Dump(v.bin))
		}
	}
}
