package kv_test

import (
	"context"
	"encoding/binary"
	"errors"
	"testing"

	"github.com/cudaipc/cudaipc/client"
	"github.com/cudaipc/cudaipc/kv"
)

// FuzzPlan checks what a daemon does with a kv_read's bytes (two
// descriptions, the block ids, the layers): it decodes them and plans the
// read, and every copy of a plan lies inside both spaces' regions and is
// of the parts' block bytes (or a piece of a run of them).
func FuzzPlan(f *testing.F) {
	enc := func(ids ...uint32) []byte {
		b := make([]byte, 0, 4*len(ids))
		for _, id := range ids {
			b = binary.LittleEndian.AppendUint32(b, id)
		}
		return b
	}
	for _, kinds := range [][2]string{{"vllm", "sglang"}, {"vllm-blocks-first", "host"}, {"host", "vllm"}} {
		s, d := testDesc(kinds[0]), testDesc(kinds[1])
		sb, _ := s.MarshalBinary()
		db, _ := d.MarshalBinary()
		f.Add(sb, db, enc(0, 9, 1, 2, 3, 4), uint16(0), uint16(0))
		f.Add(sb, db, enc(5, 6, 7, 8), uint16(1), uint16(2))
		f.Add(sb, db, enc(9, 10), uint16(2), uint16(1))
	}
	f.Fuzz(func(t *testing.T, sb, db, ids []byte, first, count uint16) {
		var src, dst kv.Desc
		if src.UnmarshalBinary(sb) != nil || dst.UnmarshalBinary(db) != nil {
			return
		}
		var srcIDs, dstIDs []int
		for i := 0; i+8 <= len(ids); i += 8 {
			srcIDs = append(srcIDs, int(binary.LittleEndian.Uint32(ids[i:])))
			dstIDs = append(dstIDs, int(binary.LittleEndian.Uint32(ids[i+4:])))
		}
		p, err := kv.NewPlan(&src, &dst, srcIDs, dstIDs, int(first), int(count))
		if err != nil {
			if !errors.Is(err, kv.ErrMismatch) && !errors.Is(err, kv.ErrBlockRange) {
				t.Fatalf("plan: %v, want ErrMismatch or ErrBlockRange", err)
			}
			return
		}
		srcRegions, dstRegions := p.Regions()
		used := func(rs []int, r int) bool {
			for _, x := range rs {
				if x == r {
					return true
				}
			}
			return false
		}
		var bytes int64
		for l := p.First; l < p.First+p.Count; l++ {
			for _, c := range p.Layer(l, 1000) {
				switch {
				case c.Bytes <= 0 || c.Bytes > 1000:
					t.Fatalf("layer %d: a copy of %d bytes", l, c.Bytes)
				case !used(srcRegions, c.SrcRegion) || !used(dstRegions, c.DstRegion):
					t.Fatalf("layer %d: a copy between regions %d and %d that Regions does not list", l, c.SrcRegion, c.DstRegion)
				case c.Src < 0 || c.Src+c.Bytes > src.Regions[c.SrcRegion].Size:
					t.Fatalf("layer %d: a copy of [%d, +%d) of source region %d of %d bytes", l, c.Src, c.Bytes, c.SrcRegion, src.Regions[c.SrcRegion].Size)
				case c.Dst < 0 || c.Dst+c.Bytes > dst.Regions[c.DstRegion].Size:
					t.Fatalf("layer %d: a copy into [%d, +%d) of destination region %d of %d bytes", l, c.Dst, c.Bytes, c.DstRegion, dst.Regions[c.DstRegion].Size)
				}
				bytes += c.Bytes
			}
			var want int64
			for _, pt := range src.Layers[l] {
				want += pt.Bytes * int64(len(srcIDs))
			}
			if bytes != want {
				t.Fatalf("layer %d: copies of %d bytes, want %d (every block of every part)", l, bytes, want)
			}
			bytes = 0
		}
	})
}

// TestReadRemoteRefused: a read of a space that names another node,
// through a daemon without a cluster, or into memory not registered, fails
// at once with ErrNotSupported; a kv_read sent anyway is INVALID.
func TestReadRemoteRefused(t *testing.T) {
	sock := startDaemon(t)
	c := dial(t, sock)
	ctx := context.Background()
	src := testDesc("vllm")
	for i := range src.Regions {
		src.Regions[i].Device = "host"
	}
	dl, dsizes := testLayout("vllm", 3, 10, 96)
	dst := &kv.Local{Layout: dl}
	for _, n := range dsizes {
		dst.Memory = append(dst.Memory, kv.Memory{Host: make([]byte, n)})
	}
	if _, err := kv.ReadBlocks(ctx, c, kv.Request{Src: &src, SrcBlocks: []int{1}, Dst: dst, DstBlocks: []int{2}}); !errors.Is(err, kv.ErrNotSupported) {
		t.Errorf("a read of another node's space through a daemon without a cluster: %v, want ErrNotSupported", err)
	}
	sb, _ := src.MarshalBinary()
	err := c.ReadSpace(ctx, client.SpaceRead{Src: sb, Dst: sb, SrcBlocks: []uint32{1}, DstBlocks: []uint32{2}}, nil)
	if !errors.Is(err, client.ErrInvalid) {
		t.Errorf("a kv_read to a daemon without a cluster: %v, want INVALID", err)
	}
}
