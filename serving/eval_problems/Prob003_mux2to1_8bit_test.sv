`timescale 1 ps/1 ps

// Stimulus generator: a few directed patterns for both values of sel,
// then random data and select values on every clock edge.
module stimulus_gen (
  input            clk,
  output reg [7:0] a,
  output reg [7:0] b,
  output reg       sel
);

  integer seed = 3003;

  initial begin
    a = 8'h00; b = 8'h00; sel = 1'b0;
    @(posedge clk, negedge clk) begin a <= 8'h5a; b <= 8'ha5; sel <= 1'b0; end
    @(posedge clk, negedge clk) begin a <= 8'h5a; b <= 8'ha5; sel <= 1'b1; end
    @(posedge clk, negedge clk) begin a <= 8'hff; b <= 8'h00; sel <= 1'b0; end
    @(posedge clk, negedge clk) begin a <= 8'hff; b <= 8'h00; sel <= 1'b1; end
    @(posedge clk, negedge clk) begin a <= 8'h01; b <= 8'h80; sel <= 1'b1; end
    @(posedge clk, negedge clk) begin a <= 8'h01; b <= 8'h80; sel <= 1'b0; end
    repeat (200) @(posedge clk, negedge clk) begin
      a   <= $random(seed);
      b   <= $random(seed);
      sel <= $random(seed);
    end
    #1 $finish;
  end

endmodule

module tb ();

  reg clk = 0;
  initial forever #5 clk = ~clk;

  wire [7:0] a;
  wire [7:0] b;
  wire       sel;
  wire [7:0] out_ref;
  wire [7:0] out_dut;

  integer errors = 0;
  integer clocks = 0;
  integer errors_out = 0;
  integer errortime_out = 0;

  stimulus_gen stim1 (
    .clk(clk),
    .a(a),
    .b(b),
    .sel(sel)
  );

  RefModule good1 (
    .a(a),
    .b(b),
    .sel(sel),
    .out(out_ref)
  );

  TopModule top_module1 (
    .a(a),
    .b(b),
    .sel(sel),
    .out(out_dut)
  );

  // Safety net against designs that hang the simulation.
  initial begin #1000000 $display("TIMEOUT"); $finish(); end

  // Bitwise match: a bit matches when it is identical (===) in both designs.
  // A bit that is x in the reference is treated as "don't care".
  wire match_out = (out_ref === (out_ref ^ out_dut ^ out_ref));

  always @(posedge clk, negedge clk) begin
    clocks = clocks + 1;
    if (!match_out) begin
      if (errors_out == 0) errortime_out = $time;
      errors_out = errors_out + 1;
    end
    if (!match_out)
      errors = errors + 1;
  end

  // Runs on every $finish (normal end or timeout).
  final begin
    if (errors_out)
      $display("Hint: Output '%s' has %1d mismatches. First mismatch occurred at time %1d.", "out", errors_out, errortime_out);
    else
      $display("Hint: Output '%s' has no mismatches.", "out");
    $display("Hint: Total mismatched samples is %1d out of %1d samples", errors, clocks);
    $display("Simulation finished at %1d ps", $time);
    $display("Mismatches: %1d in %1d samples", errors, clocks);
  end

endmodule
