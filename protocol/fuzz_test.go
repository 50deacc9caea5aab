package protocol

import (
	"errors"
	"io"
	"os"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/cudaipc/cudaipc/protocol/storev1"
	"google.golang.org/protobuf/proto"
)

// seedRequests are valid requests of every kind, for the fuzz corpora.
func seedRequests() []*storev1.Request {
	return []*storev1.Request{
		{Id: 1, Body: &storev1.Request_Hello{Hello: &storev1.HelloRequest{Version: 1, ClientName: "py-client"}}},
		createRequest(2, "tensor-0", 1<<20),
		{Id: 3, Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: "tensor-0"}}},
		{Id: 3, Body: &storev1.Request_Seal{Seal: &storev1.SealRequest{Name: ".put-ahead.1.1", Rename: "tensor-0",
			Tensor: &storev1.TensorDesc{Dtype: "uint8", Shape: []int64{1 << 20}}, WaitEvent: make([]byte, 124)}}},
		{Id: 4, Body: &storev1.Request_Abort{Abort: &storev1.AbortRequest{Name: "tensor-0"}}},
		{Id: 5, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "tensor-0", TimeoutMs: -1}}},
		{Id: 5, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "model", Tensors: []string{"layer.3.w", "layer.1.w"}}}},
		{Id: 5, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: "model", Tensors: []string{"a", "a"}}}},
		{Id: 6, Body: &storev1.Request_Release{Release: &storev1.ReleaseRequest{LeaseId: 17}}},
		{Id: 7, Body: &storev1.Request_Delete{Delete: &storev1.DeleteRequest{Name: "tensor-0"}}},
		{Id: 8, Body: &storev1.Request_List{List: &storev1.ListRequest{StartAfter: "t"}}},
		{Id: 9, Body: &storev1.Request_Stat{Stat: &storev1.StatRequest{Name: "tensor-0"}}},
		{Id: 10, Body: &storev1.Request_Subscribe{Subscribe: &storev1.SubscribeRequest{}}},
		{Id: 11, Body: &storev1.Request_PoolCreate{PoolCreate: &storev1.PoolCreateRequest{Name: "pool", BlockBytes: 2 << 20, KeyBytes: 32, Capacity: 1 << 30}}},
		{Id: 12, Body: &storev1.Request_BlockPut{BlockPut: &storev1.BlockPutRequest{Pool: "pool", Count: 1, Keys: &storev1.Blob{Data: make([]byte, 32)},
			Source: &storev1.BlockSource{Regions: []string{"kv/0"}, Parts: []*storev1.BlockPart{{Base: 0, Stride: 64, Bytes: 64}}, Ids: &storev1.Blob{Data: make([]byte, 4)}}}}},
		{Id: 13, Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "pool", Count: 2, Keys: &storev1.Blob{Offset: 64, Length: 64}, Pin: true, TimeoutMs: 300}}},
		{Id: 13, Body: &storev1.Request_BlockLookup{BlockLookup: &storev1.BlockLookupRequest{Pool: "pool", Count: 3, Keys: &storev1.Blob{Data: make([]byte, 48)}, PerKey: true, PresentAt: 4096}}},
		{Id: 14, Body: &storev1.Request_BlockGet{BlockGet: &storev1.BlockGetRequest{Pool: "pool", Count: 1, Keys: &storev1.Blob{Data: make([]byte, 16)}, Pin: 3}}},
		{Id: 15, Body: &storev1.Request_BlockUnpin{BlockUnpin: &storev1.BlockUnpinRequest{Pin: 3}}},
	}
}

func seedResponses() []*storev1.Response {
	return []*storev1.Response{
		{Id: 1, Body: &storev1.Response_Hello{Hello: &storev1.HelloResponse{Version: 1, ServerVersion: "dev", Pid: 42, Backend: "host"}}},
		{Id: 2, Body: &storev1.Response_Create{Create: &storev1.CreateResponse{Placement: placement(true, true)}}},
		{Id: 5, Body: &storev1.Response_Get{Get: &storev1.GetResponse{LeaseId: 3, Placement: placement(false, false), Info: info("x")}}},
		ListPage(8, []*storev1.ObjectInfo{info("a"), info("b")}),
		{Id: 9, Body: &storev1.Response_Stat{Stat: &storev1.StatResponse{Info: info("x")}}},
		{Id: 11, Body: &storev1.Response_Get{Get: &storev1.GetResponse{LeaseId: 4,
			Placement: &storev1.Placement{Device: "GPU-0", Size: 3 << 20, ArenaSize: 3 << 20, External: true, Files: 2, Region: make([]byte, 212), Kind: storev1.Placement_VMM_FD},
			Info:      &storev1.ObjectInfo{Name: "ext", Size: 3 << 20, Device: "GPU-0", Sealed: true, External: true}}}},
		{Id: 12, Body: &storev1.Response_StageFiles{StageFiles: &storev1.StageFilesResponse{Staged: 120}}},
		{Id: 13, Body: &storev1.Response_Files{Files: &storev1.FilesResponse{From: 60, Count: 2}}},
		{Id: 3, Body: &storev1.Response_Seal{Seal: &storev1.SealResponse{}}},
		NewEvent(storev1.Event_EVICTED, "x"),
		ErrorResponse(4, Errorf(storev1.Error_STORE_FULL, "need %d bytes", 1<<30)),
		ErrorResponse(14, Errorf(storev1.Error_UNAVAILABLE, "cluster directory unavailable")),
		ErrorResponse(15, Errorf(storev1.Error_DATA_LOSS, "record does not verify")),
		{Id: 16, Body: &storev1.Response_PoolStat{PoolStat: &storev1.PoolStatResponse{FdAttached: true, Info: &storev1.PoolInfo{Name: "pool", Id: 1,
			BlockBytes: 96, KeyBytes: 32, SlotBytes: 256, CapacityBlocks: 16, MemorySize: 4096, Device: "host"}}}},
		{Id: 17, Body: &storev1.Response_BlockGet{BlockGet: &storev1.BlockGetResponse{Pin: 2, Found: 1, PoolId: 1, Slots: &storev1.Blob{Data: make([]byte, 8)}}}},
	}
}

// fuzzDecode sends data as one raw packet with nfiles descriptors attached
// and receives it into m, checking the Conn's guarantees: the error is one
// of the documented ones, oversized packets are refused, and no received
// descriptor outlives the call.
func fuzzDecode(t *testing.T, raw *os.File, c *Conn, data []byte, nfiles uint8, m proto.Message) (ok bool, files int) {
	if len(data) > 3*MaxMessageSize {
		t.Skip("larger than the socket buffer")
	}
	n := int(nfiles) % (MaxFiles + 3)
	probes := make([]*leakProbe, n)
	fds := make([]int, n)
	for i := range probes {
		probes[i] = newLeakProbe(t)
		fds[i] = int(probes[i].w.Fd())
	}
	sendRaw(t, raw, data, fds...)
	got, err := c.Recv(m)
	CloseFiles(got)
	for i, p := range probes {
		if !p.closedEverywhere(t) {
			t.Fatalf("descriptor %d of %d leaked (Recv error: %v)", i, n, err)
		}
	}
	if err != nil {
		var me *MessageError
		switch {
		case err == io.EOF && len(data) == 0 && n == 0:
		case errors.As(err, &me) && (errors.Is(err, ErrTooLarge) || errors.Is(err, ErrMalformed) || errors.Is(err, ErrTooManyFiles)):
		default:
			t.Fatalf("Recv of %d bytes, %d fds: unexpected error %v", len(data), n, err)
		}
		if got != nil {
			t.Fatal("files returned with an error")
		}
		return false, 0
	}
	if len(data) > MaxMessageSize || n > MaxFiles {
		t.Fatalf("Recv accepted %d bytes with %d fds", len(data), n)
	}
	if len(got) != n {
		t.Fatalf("sent %d fds, received %d", n, len(got))
	}
	return true, len(got)
}

func FuzzDecodeRequest(f *testing.F) {
	for i, r := range seedRequests() {
		f.Add(mustMarshal(f, r), uint8(i%2))
	}
	f.Add([]byte{0x08, 0x01, 0x5a, 0x04, 0x0a, 0x02, 0xff, 0xfe}, uint8(0))
	// Registrations: VMM pieces with one descriptor each, and a legacy one.
	reg := &storev1.Request{Id: 9, Body: &storev1.Request_Register{Register: &storev1.RegisterRequest{
		Name: "torch/w0", Size: 3 << 20, Device: "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8",
		Region: make([]byte, 188), Files: 2}}}
	f.Add(mustMarshal(f, reg), uint8(2))
	f.Add(mustMarshal(f, reg), uint8(3))
	legacy := &storev1.Request{Id: 10, Body: &storev1.Request_Register{Register: &storev1.RegisterRequest{
		Name: "cupy/a", Size: 4096, Device: "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8", Region: make([]byte, 164)}}}
	f.Add(mustMarshal(f, legacy), uint8(0))
	// More descriptors than a packet carries: staged, then the register.
	stage := &storev1.Request{Id: 11, Body: &storev1.Request_StageFiles{StageFiles: &storev1.StageFilesRequest{}}}
	f.Add(mustMarshal(f, stage), uint8(3))
	big := &storev1.Request{Id: 12, Body: &storev1.Request_Register{Register: &storev1.RegisterRequest{
		Name: "torch/big", Size: 3 << 20, Device: "GPU-5f1c2a3b-4d5e-6f70-8192-a3b4c5d6e7f8", Region: make([]byte, 188), Files: 205}}}
	f.Add(mustMarshal(f, big), uint8(1))
	files := &storev1.Request{Id: 13, Body: &storev1.Request_Files{Files: &storev1.FilesRequest{LeaseId: 4, From: 60}}}
	f.Add(mustMarshal(f, files), uint8(0))
	// A KV read across nodes, and its cancel.
	kvRead := &storev1.Request{Id: 14, Body: &storev1.Request_KvRead{KvRead: &storev1.KvReadRequest{
		Src: []byte("CKVS-src"), Dst: []byte("CKVS-dst"), SrcBlocks: []uint32{3, 1, 40000}, DstBlocks: []uint32{0, 1, 2}, First: 2, Count: 30, TimeoutMs: 500}}}
	f.Add(mustMarshal(f, kvRead), uint8(0))
	f.Add(mustMarshal(f, &storev1.Request{Id: 15, Body: &storev1.Request_KvCancel{KvCancel: &storev1.KvCancelRequest{ReadId: 14}}}), uint8(0))
	raw, sock := socketpair(f)
	c := newConn(f, sock)
	f.Fuzz(func(t *testing.T, data []byte, nfiles uint8) {
		var req storev1.Request
		ok, files := fuzzDecode(t, raw, c, data, nfiles, &req)
		if !ok {
			return
		}
		if err := ValidateRequest(&req, files); err != nil {
			if !errors.Is(err, ErrInvalid) || CodeOf(err) != storev1.Error_INVALID {
				t.Fatalf("ValidateRequest error %v is not INVALID", err)
			}
			// The daemon answers with this; it must fit in a packet.
			if b, err := proto.Marshal(ErrorResponse(req.GetId(), err)); err != nil || len(b) > MaxMessageSize {
				t.Fatalf("error response: %d bytes, %v", len(b), err)
			}
			return
		}
		if reg := req.GetRegister(); reg != nil {
			if files > int(reg.GetFiles()) || files > MaxFiles || reg.GetFiles() > MaxPieces || (len(reg.GetRegion()) == 0) != (reg.GetDevice() == "host") || len(reg.GetSpace()) > MaxSpaceSize {
				t.Fatalf("ValidateRequest accepted a register of %d descriptors with %d files", reg.GetFiles(), files)
			}
			files = 0
		}
		if req.GetStageFiles() != nil {
			if files < 1 || files > MaxFiles {
				t.Fatalf("ValidateRequest accepted a stage_files with %d files", files)
			}
			files = 0
		}
		if BlockRequest(&req) {
			if files > 1 {
				t.Fatalf("ValidateRequest accepted a block request with %d files", files)
			}
			files = 0 // its bulk file
		}
		if files != 0 || req.GetId() == 0 || RequestKind(&req) == "unknown" {
			t.Fatalf("ValidateRequest accepted %v with %d files", &req, files)
		}
		if r := req.GetKvRead(); r != nil && (len(r.GetSrc()) == 0 || len(r.GetSrc()) > MaxSpaceSize || len(r.GetDst()) == 0 || len(r.GetDst()) > MaxSpaceSize ||
			len(r.GetSrcBlocks()) == 0 || len(r.GetSrcBlocks()) != len(r.GetDstBlocks()) || r.GetFirst() >= MaxKVLayers || r.GetCount() > MaxKVLayers) {
			t.Fatalf("ValidateRequest accepted a kv_read of %d and %d blocks, descriptions of %d and %d bytes, layers %d+%d", len(r.GetSrcBlocks()), len(r.GetDstBlocks()), len(r.GetSrc()), len(r.GetDst()), r.GetFirst(), r.GetCount())
		}
		if c := req.GetCreate(); c != nil && (c.GetSize() == 0 || c.GetSize() > MaxObjectSize) {
			t.Fatalf("accepted size %d", c.GetSize())
		}
		if g := req.GetGet(); g != nil {
			seen := map[string]bool{}
			for _, n := range g.GetTensors() {
				if n == "" || seen[n] {
					t.Fatalf("accepted tensors %q", g.GetTensors())
				}
				seen[n] = true
			}
		}
	})
}

func FuzzDecodeResponse(f *testing.F) {
	for i, r := range seedResponses() {
		f.Add(mustMarshal(f, r), uint8(i%2))
	}
	raw, sock := socketpair(f)
	c := newConn(f, sock)
	f.Fuzz(func(t *testing.T, data []byte, nfiles uint8) {
		var resp storev1.Response
		ok, files := fuzzDecode(t, raw, c, data, nfiles, &resp)
		if !ok {
			return
		}
		rerr := ResponseError(&resp)
		if rerr != nil && CodeOf(rerr) != resp.GetError().GetCode() {
			t.Fatalf("ResponseError code %v, response code %v", CodeOf(rerr), resp.GetError().GetCode())
		}
		if err := ValidateResponse(&resp, files); err != nil {
			if !errors.Is(err, ErrMalformed) {
				t.Fatalf("ValidateResponse error %v is not ErrMalformed", err)
			}
			return
		}
		if rerr != nil {
			if resp.GetBody() != nil || files != 0 {
				t.Fatal("accepted an error response with a body or files")
			}
			return
		}
		for _, p := range []*storev1.Placement{resp.GetCreate().GetPlacement(), resp.GetGet().GetPlacement()} {
			if p == nil {
				continue
			}
			manifests := 0
			if resp.GetCreate().GetManifestAttached() || resp.GetGet().GetManifestAttached() {
				manifests = 1
			}
			// What a client will do with it: slice [offset, offset+size)
			// out of a mapping of arena_size bytes.
			end := p.GetOffset() + p.GetSize()
			if end < p.GetOffset() || end > p.GetArenaSize() || p.GetSize() == 0 {
				t.Fatalf("accepted placement %v", p)
			}
			if p.GetExternal() {
				if files-manifests != min(int(p.GetFiles()), MaxFiles) || p.GetFdAttached() {
					t.Fatalf("accepted an external placement of %d descriptors with %d files", p.GetFiles(), files)
				}
				continue
			}
			if p.GetFdAttached() != (files-manifests == 1) {
				t.Fatalf("accepted fd_attached=%v with %d files", p.GetFdAttached(), files)
			}
		}
		if fr := resp.GetFiles(); fr != nil && (files != int(fr.GetCount()) || files == 0 || files > MaxFiles) {
			t.Fatalf("accepted files %v with %d files", fr, files)
		}
		if (resp.GetId() == 0) != (resp.GetEvent() != nil) {
			t.Fatalf("accepted id %d with body %T", resp.GetId(), resp.GetBody())
		}
	})
}

func FuzzValidateName(f *testing.F) {
	for _, s := range []string{"a", "tensor-0", "a/b", "", "\x00", "é", "\u202e", strings.Repeat("x", 256), " 65534:x", "065534:x", "65534:x", "x "} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		err := ValidateName(name)
		if err != nil {
			if !errors.Is(err, ErrInvalid) || CodeOf(err) != storev1.Error_INVALID {
				t.Fatalf("ValidateName(%q) = %v, not INVALID", name, err)
			}
			return
		}
		limit := MaxNameLen
		if _, _, ok := SplitOwner(name); ok {
			limit = MaxQualifiedNameLen
		}
		if len(name) == 0 || len(name) > limit || !utf8.ValidString(name) || strings.ContainsAny(name, "\x00\n\r\t\x7f") {
			t.Fatalf("ValidateName accepted %q", name)
		}
		if strings.TrimSpace(name) != name {
			t.Fatalf("ValidateName accepted %q, which starts or ends with a space", name)
		}
		// A uid prefix is canonical: what looks like one is one.
		if i := strings.IndexByte(name, ':'); i > 0 && i < len(name)-1 && strings.Trim(name[:i], "0123456789 ") == "" {
			if _, _, ok := SplitOwner(name); !ok {
				t.Fatalf("ValidateName accepted %q, whose uid prefix is not canonical", name)
			}
		}
		for i := 0; i < len(name); i++ {
			if name[i] < 0x20 {
				t.Fatalf("ValidateName accepted control byte in %q", name)
			}
		}
		// A valid name survives the wire in every request that takes one.
		for _, r := range []*storev1.Request{
			createRequest(1, name, 1),
			{Id: 1, Body: &storev1.Request_Get{Get: &storev1.GetRequest{Name: name}}},
			{Id: 1, Body: &storev1.Request_List{List: &storev1.ListRequest{StartAfter: name}}},
		} {
			var back storev1.Request
			if err := proto.Unmarshal(mustMarshal(t, r), &back); err != nil {
				t.Fatal(err)
			}
			if err := ValidateRequest(&back, 0); err != nil {
				t.Fatalf("valid name %q: %v", name, err)
			}
		}
	})
}

func FuzzValidateCreate(f *testing.F) {
	f.Add("x", uint64(1), "host", "client")
	f.Add("x", uint64(0), "", "")
	f.Add("x", uint64(1<<40+1), "GPU-0", "a\tb")
	f.Fuzz(func(t *testing.T, name string, size uint64, device, clientName string) {
		serr, derr := ValidateSize(size), ValidateDevice(device)
		if (serr == nil) != (size >= 1 && size <= MaxObjectSize) {
			t.Fatalf("ValidateSize(%d) = %v", size, serr)
		}
		if derr == nil {
			for i := 0; i < len(device); i++ {
				if device[i] <= ' ' || device[i] > '~' {
					t.Fatalf("ValidateDevice accepted %q", device)
				}
			}
			if len(device) > MaxDeviceLen {
				t.Fatalf("ValidateDevice accepted %d bytes", len(device))
			}
		}
		req := &storev1.Request{Id: 1, Body: &storev1.Request_Create{Create: &storev1.CreateRequest{Name: name, Size: size, Device: device}}}
		want := ValidateName(name) == nil && serr == nil && derr == nil
		if err := ValidateRequest(req, 0); (err == nil) != want {
			t.Fatalf("ValidateRequest(%v) = %v, want ok=%v", req, err, want)
		}
		hello := &storev1.Request{Id: 1, Body: &storev1.Request_Hello{Hello: &storev1.HelloRequest{Version: 1, ClientName: clientName}}}
		if err := ValidateRequest(hello, 0); err == nil {
			if len(clientName) > MaxClientNameLen || !utf8.ValidString(clientName) || strings.ContainsAny(clientName, "\x00\n\x7f") {
				t.Fatalf("accepted client name %q", clientName)
			}
		}
	})
}

// FuzzLeaseSlot: whatever word a client (or a misbehaving one) leaves in a
// lease slot, the daemon reclaims only the idle lease it granted, and a
// client takes back or releases through memory only its own lease in the
// exact state expected.
func FuzzLeaseSlot(f *testing.F) {
	f.Add(uint64(0), uint64(1))
	f.Add(SlotWord(7, SlotIdle, false), uint64(7))
	f.Add(SlotWord(7, SlotHeld, true), uint64(7))
	f.Add(^uint64(0), uint64(MaxSlotGen))
	f.Fuzz(func(t *testing.T, w, gen uint64) {
		gen &= MaxSlotGen
		g, st, doomed := DecodeSlot(w)
		if SlotWord(g, st, doomed) != w {
			t.Fatalf("word %#x does not round-trip", w)
		}
		if next, ok := SlotReclaim(w, gen); ok {
			if g != gen || st != SlotIdle || next != SlotWord(gen, SlotFree, false) {
				t.Fatalf("reclaimed %#x for gen %d", w, gen)
			}
		}
		if next, ok := SlotRelease(w, gen); ok {
			if w != SlotWord(gen, SlotHeld, false) || next != SlotWord(gen, SlotIdle, false) {
				t.Fatalf("released %#x for gen %d", w, gen)
			}
		}
		old, next := SlotRetake(gen)
		if _, st, d := DecodeSlot(old); st != SlotIdle || d {
			t.Fatal("retake expects a non-idle word")
		}
		if _, st, _ := DecodeSlot(next); st != SlotHeld {
			t.Fatal("retake swaps in a non-held word")
		}
	})
}
