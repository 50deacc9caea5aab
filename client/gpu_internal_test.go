package client

import (
	"encoding/json"
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	"github.com/cudaipc/cudaipc"
	"github.com/cudaipc/cudaipc/protocol/storev1"
)

func TestResolveDevice(t *testing.T) {
	for in, want := range map[string]string{
		"":                                 "",
		"host":                             "host",
		"5F1C2A3B4D5E6F708192A3B4C5D6E7F8": "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8",
		"GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8": "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8",
	} {
		if got, err := resolveDevice(in); err != nil || got != want {
			t.Errorf("resolveDevice(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := resolveDevice("tpu0"); err == nil {
		t.Error("resolveDevice accepted tpu0")
	}
	// An ordinal this process does not have (or no driver at all).
	if _, err := resolveDevice("99"); err == nil {
		t.Error("resolveDevice accepted ordinal 99")
	}
}

func TestDecodeRegion(t *testing.T) {
	u, _ := cudaipc.ParseUUID("GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8")
	r := cudaipc.Region{
		Version: cudaipc.RegionVersion, Kind: cudaipc.KindCUDAIPC, Handle: cudaipc.MemHandle{1},
		Offset: 1 << 20, Size: 4096, AllocSize: 64 << 20, Device: u,
		ExporterPID: 4242, PIDNamespace: 4026531836, BootID: cudaipc.BootID{2},
		BufferID: 17, ExporterBase: 0x7f3a00000000,
	}
	bin, err := r.MarshalBinary()
	if err != nil {
		t.Fatal(err)
	}
	got := decodeRegion(bin)
	if got == nil || !got.Equal(r) {
		t.Fatalf("decodeRegion = %v, want %v", got, r)
	}
	// ObjectInfo prints it in the JSON encoding of docs/region.md.
	j, err := json.Marshal(ObjectInfo{Region: got})
	var obj struct{ Region map[string]any }
	if err != nil || json.Unmarshal(j, &obj) != nil || obj.Region["kind"] != "cuda-ipc" {
		t.Fatalf("ObjectInfo JSON = %s (%v)", j, err)
	}
	if decodeRegion(nil) != nil || decodeRegion([]byte("junk")) != nil {
		t.Fatal("no region, or junk, decoded")
	}
	if j, _ := json.Marshal(ObjectInfo{}); !strings.Contains(string(j), `"region":null`) {
		t.Fatalf("host object's JSON: %s", j)
	}
}

func TestHostView(t *testing.T) {
	v := view{device: "host", size: 8, data: make([]byte, 8), open: true}
	if n, err := v.writeAt("write", "x", []byte{1, 2, 3}, 6); err == nil || n != 0 {
		t.Fatalf("write past the end: %d, %v", n, err)
	}
	if _, err := v.writeAt("write", "x", []byte{7, 8, 9}, 5); err != nil {
		t.Fatal(err)
	}
	p := make([]byte, 4)
	if n, err := v.readAt("read", "x", p, 5); n != 3 || err != io.EOF || p[0] != 7 || p[2] != 9 {
		t.Fatalf("short read: %d, %v, %v", n, err, p)
	}
	if v.ptr() != 0 || v.mapping() != nil {
		t.Fatal("host view has a device pointer")
	}
	if err := v.close(); err != nil {
		t.Fatal(err)
	}
	if _, err := v.readAt("read", "x", p, 0); !errors.Is(err, ErrInvalid) {
		t.Fatalf("read after close: %v", err)
	}
	if _, err := v.writeAt("write", "x", p, 0); !errors.Is(err, ErrInvalid) {
		t.Fatalf("write after close: %v", err)
	}
}

// A reply carries what its placement's kind needs: the host arena's
// mapping, nothing for a cuda-ipc region, the descriptor of a vmm-fd one,
// and for registered memory as many descriptors as the placement says.
func TestReplyHolds(t *testing.T) {
	f, err := os.Open(os.DevNull)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	one, three := []*os.File{f}, []*os.File{f, f, f}
	for _, tc := range []struct {
		p    *storev1.Placement
		hold reply // the reply that carries what the placement needs; the others do not
	}{
		{&storev1.Placement{Kind: storev1.Placement_HOST}, reply{m: &mapping{}}},
		{&storev1.Placement{Kind: storev1.Placement_CUDA_IPC}, reply{}},
		{&storev1.Placement{Kind: storev1.Placement_VMM_FD}, reply{files: one}},
		{&storev1.Placement{Kind: storev1.Placement_VMM_FD, External: true, Files: 3}, reply{files: three}},
		{&storev1.Placement{Kind: storev1.Placement_CUDA_IPC, External: true}, reply{}},
		{&storev1.Placement{Kind: storev1.Placement_KIND_UNSPECIFIED}, reply{m: &mapping{}, files: one}}, // none holds it
	} {
		for _, r := range []reply{{}, {m: &mapping{}}, {files: one}, {files: three}} {
			want := (tc.hold.m != nil) == (r.m != nil) && len(tc.hold.files) == len(r.files)
			if got := r.holds(tc.p); got != want {
				t.Errorf("placement %v: reply (mapping %v, %d files) holds = %v", tc.p, r.m != nil, len(r.files), got)
			}
		}
	}
}
